"""The transformers rollout engine: a hand-written sampling loop over a KV cache, batched with left padding,
for CPU runs and tests. It shares the policy module (or owns a copy) and implements `rollout.engine.Engine`.

Why not `model.generate`: the loop needs the logprob of each sampled token under exactly the distribution it
was drawn from, explicit sampling fields with nothing read from the model's generation_config, and the
option to drop finished rows from the batch (and the cache) so long-tail completions do not pay for short
ones. The loop does all three in about 100 lines; bench/generate.py compares its speed with `generate`.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch
from torch import Tensor

from rollout.engine import (
    Completion, completion_text, is_out_of_memory, raise_out_of_memory, torch_threads, validate_request,
)
from rollout.sampling import sample_next_tokens


class HFEngine:
    """Generate with a transformers causal LM.

    model:         a plain (not FSDP-sharded) transformers causal LM.
    tokenizer:     its tokenizer (decodes completions and checks stop strings).
    shared:        True when `model` is the policy being trained: `update_weights` is then a no-op (the engine
                   already sees every optimizer step) and the model's train/eval mode is restored after each
                   `generate`. False when the engine owns its copy: `update_weights` copies into it by name.
    eos_token_ids: token ids that end a completion (finish reason "stop"); default: the tokenizer's eos.
    max_context:   the most tokens a sequence may hold; default: the model's max_position_embeddings.
    num_threads:   torch intra-op threads while generating (see `rollout.engine.torch_threads`); the caller's
                   setting is restored afterwards. None leaves torch's setting as it is; 1 is faster on a
                   CPU that other jobs share.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        *,
        shared: bool = True,
        eos_token_ids: Sequence[int] | None = None,
        max_context: int | None = None,
        num_threads: int | None = None,
    ):
        sharded = [name for name, parameter in model.named_parameters() if type(parameter).__name__ == "DTensor"]
        if sharded:
            # Each rank would stop generating at a different step and deadlock inside FSDP's all-gathers.
            raise ValueError(
                f"HFEngine needs an unsharded model, but parameter {sharded[0]!r} is an FSDP DTensor: build the "
                f"engine on a full copy (shared=False) and push weights with rollout.sync.sync_weights"
            )
        self.model = model
        self.tokenizer = tokenizer
        self.shared = shared
        self.num_threads = num_threads
        if eos_token_ids is None:
            if tokenizer.eos_token_id is None:
                raise ValueError("the tokenizer has no eos_token_id: pass eos_token_ids explicitly")
            eos_token_ids = [tokenizer.eos_token_id]
        self.eos_token_ids = sorted(set(int(token) for token in eos_token_ids))
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token_ids[0]
        self.max_context = int(max_context or model.config.max_position_embeddings)
        self.vocab_size = model.get_input_embeddings().weight.shape[0]
        # A padded vocabulary (more model rows than tokenizer entries) has ids with no text: never sample them.
        self.num_text_tokens = min(len(tokenizer), model.get_output_embeddings().weight.shape[0])

    def generate(
        self,
        prompts: list[list[int]],
        *,
        n: int = 1,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop: Sequence[str] | None = None,
        seed: int | None = None,
    ) -> list[Completion]:
        """Sample n completions per prompt; returns B = len(prompts) * n, each prompt's n consecutive.

        seed: the same seed, prompts and weights give the same completions; None draws one from torch's RNG.
        """
        stop_strings = validate_request(
            prompts, n=n, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
            stop=stop, seed=seed, max_context=self.max_context, vocab_size=self.vocab_size,
        )
        rows = [list(prompt) for prompt in prompts for _ in range(n)]
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), torch_threads(self.num_threads):
                return self._sample(prompts, n, max_new_tokens, temperature, top_p, top_k, stop_strings, seed)
        except RuntimeError as error:
            if is_out_of_memory(error):
                raise_out_of_memory(error, len(rows), max_new_tokens)
            raise
        finally:
            self.model.train(was_training)

    def _sample(self, prompts, n, max_new_tokens, temperature, top_p, top_k, stop_strings, seed) -> list[Completion]:
        """The decoding loop. Each prompt is prefilled once and its KV cache copied to its n rows.
        Rows that finish leave the batch: `active` maps batch rows to `rows` indices."""
        device = self.model.get_input_embeddings().weight.device
        generator = torch.Generator(device=device)
        generator.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
        rows = [list(prompt) for prompt in prompts for _ in range(n)]
        batch_size = len(rows)
        # Per-row budget: max_new_tokens, cut to what the context leaves after the prompt.
        budget = [min(max_new_tokens, self.max_context - len(row)) for row in rows]
        prompt_len = max(len(prompt) for prompt in prompts)
        input_ids = torch.full((len(prompts), prompt_len), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), prompt_len), dtype=torch.long)
        for index, prompt in enumerate(prompts):
            input_ids[index, prompt_len - len(prompt):] = torch.tensor(prompt)
            attention_mask[index, prompt_len - len(prompt):] = 1
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        # The same positions as models.batching.pad_batch, so rollout and trainer logprobs agree.
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        eos = torch.tensor(self.eos_token_ids, device=device)
        completion_ids: list[list[int]] = [[] for _ in rows]
        logprobs: list[list[float]] = [[] for _ in rows]
        finish_reason = ["length"] * batch_size
        active = list(range(batch_size))
        cache = _new_cache(self.model)
        prefill_rows = torch.arange(len(prompts), device=device).repeat_interleave(n)
        while True:
            logits = self.model(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                past_key_values=cache, use_cache=True, logits_to_keep=1,
            ).logits[:, -1, :]
            if prefill_rows is not None:  # after the prefill: from one row per prompt to n
                cache.batch_select_indices(prefill_rows)
                logits, attention_mask = logits[prefill_rows], attention_mask[prefill_rows]
                position_ids, prefill_rows = position_ids[prefill_rows], None
            if self.num_text_tokens < logits.shape[-1]:
                logits[:, self.num_text_tokens:] = float("-inf")
            tokens, token_logprobs = sample_next_tokens(
                logits, temperature=temperature, top_p=top_p, top_k=top_k, generator=generator
            )
            is_eos = torch.isin(tokens, eos).tolist()
            tokens_list, token_logprobs_list = tokens.tolist(), token_logprobs.tolist()
            keep = []
            for batch_row, row in enumerate(active):
                completion_ids[row].append(tokens_list[batch_row])
                logprobs[row].append(token_logprobs_list[batch_row])
                if is_eos[batch_row] or self._hit_stop_string(completion_ids[row], stop_strings):
                    finish_reason[row] = "stop"
                elif len(completion_ids[row]) < budget[row]:
                    keep.append(batch_row)
            if not keep:
                break
            if len(keep) < len(active):
                keep_index = torch.tensor(keep, device=device)
                cache.batch_select_indices(keep_index)
                tokens, attention_mask = tokens[keep_index], attention_mask[keep_index]
                position_ids = position_ids[keep_index]
                active = [active[batch_row] for batch_row in keep]
            input_ids = tokens[:, None]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(active), 1))], dim=-1)
            position_ids = position_ids[:, -1:] + 1
        return [
            Completion(
                prompt_ids=rows[index], completion_ids=completion_ids[index],
                text=completion_text(self.tokenizer, completion_ids[index]),
                logprobs=logprobs[index], finish_reason=finish_reason[index],
            )
            for index in range(batch_size)
        ]

    def _hit_stop_string(self, completion_ids: list[int], stop_strings: list[str]) -> bool:
        """True once the decoded completion contains a stop string (checked after every new token, so the
        first True is at the token that completed it)."""
        if not stop_strings:
            return False
        text = completion_text(self.tokenizer, completion_ids)
        return any(stop_string in text for stop_string in stop_strings)

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Copy HF-named full tensors into the engine's own model (a no-op when it shares the policy)."""
        if self.shared:
            for _ in named_tensors:  # consume the stream: a distributed producer may depend on it
                pass
            return
        # Persistent buffers too: models.fsdp.full_state_dict streams them beside the parameters.
        parameters = dict(self.model.named_parameters(remove_duplicate=False))
        parameters.update(self.model.named_buffers())
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name not in parameters:
                    raise ValueError(f"update_weights: the engine's model has no parameter named {name!r}")
                target = parameters[name]
                if tuple(target.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"update_weights: {name!r} has shape {tuple(tensor.shape)}, the engine's model expects "
                        f"{tuple(target.shape)}"
                    )
                target.copy_(tensor)

    def sleep(self) -> None:
        """No-op: a transformers model has no separate generation memory to free between rollouts."""

    def wake(self) -> None:
        """No-op (see `sleep`)."""


def _new_cache(model: torch.nn.Module):
    """An empty dynamic KV cache for `model` (transformers 5 builds per-layer caches from the config)."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)
