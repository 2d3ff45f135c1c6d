"""The transformers rollout engine: a hand-written sampling loop over a KV cache, batched with left padding,
for CPU runs and tests. It shares the policy module (or owns a copy) and implements `rollout.engine.Engine`.

Why not `model.generate`: the loop needs the logprob of each sampled token under exactly the distribution it
was drawn from, explicit sampling fields with nothing read from the model's generation_config, and the
option to drop finished rows from the batch (and the cache) so long-tail completions do not pay for short
ones. bench/generate.py compares its speed with `generate`.

A decode step moves one token per row through every layer, so its cost is small operations and reading the
weights; the loop avoids what transformers adds on CPU: grouped-query attention without copying the key/value
heads (models.attention), a cache allocated once (rollout.kv_cache), each prompt's keys held once for its G rows
(rollout.kv_cache.SharedPrefixCache), a written-out decode step on weights stacked and reordered for oneDNN
(rollout.decode_step), the vocabulary projection in slices (`_project`) and inverse-CDF sampling
(rollout.sampling). What is left is bound by memory bandwidth. torch.compile of the decoder is not used: it
compiles slowly and is no faster per step, since the matmuls go to the same kernels. The measured profile of
a step, change by change, is in bench/README.md ("Decode-step profile").
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch
from torch import Tensor

from models.attention import SDPA_NATIVE_GQA, attention_implementation
from models.logprobs import logit_transform
from rollout.engine import (
    Completion, completion_text, is_out_of_memory, raise_out_of_memory, torch_threads, validate_request,
)
from rollout.decode_step import DecodeWeights, decode_step, linear, pack_decode_weights, supports_decode_step
from rollout.kv_cache import SharedPrefixCache, prefix_attention_available, preallocated_cache
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
        # transformers' sdpa copies every key/value head num_key_value_groups times per token on CPU; the same
        # kernel with native grouped-query attention does not (models.attention). Other implementations stay.
        self._attention = SDPA_NATIVE_GQA if model.config._attn_implementation == "sdpa" else None
        head = model.get_output_embeddings()
        # The decoder + sliced projection path needs logits that are exactly a plain linear head's output.
        plain = type(head) is torch.nn.Linear and logit_transform(model) is None and hasattr(model, "get_decoder")
        self._head = head if plain else None
        self._decoder = model.get_decoder() if self._head is not None else None
        # The written-out decode step takes the additive mask that only our sdpa function's path builds.
        self._step_by_hand = self._head is not None and self._attention is not None and supports_decode_step(model)

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
        """The decoding loop. Each prompt is prefilled once and its KV cache copied to its n rows; rows that
        finish leave the batch (and the cache). Per token, the bookkeeping is a few tensor operations over the
        batch; text is decoded per token only when there are stop strings. B = len(prompts) * n rows."""
        device = self.model.get_input_embeddings().weight.device
        generator = torch.Generator(device=device)
        generator.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
        prompt_lengths = torch.tensor([len(prompt) for prompt in prompts]).repeat_interleave(n)
        # Per-row budget [B]: max_new_tokens, cut to what the context leaves after the prompt.
        budget = (self.max_context - prompt_lengths).clamp(max=max_new_tokens).to(device)
        steps, prompt_len = int(budget.max()), max(len(prompt) for prompt in prompts)
        input_ids = torch.full((len(prompts), prompt_len), self.pad_token_id, dtype=torch.long)
        # [rows, prompt + completion columns]: prompts left-padded, every completion column real.
        attention_mask = torch.ones((len(prompts), prompt_len + steps), dtype=torch.long)
        for index, prompt in enumerate(prompts):
            input_ids[index, prompt_len - len(prompt):] = torch.tensor(prompt)
            attention_mask[index, : prompt_len - len(prompt)] = 0
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        # The same positions as models.batching.pad_batch, so rollout and trainer logprobs agree.
        position_ids = (attention_mask[:, :prompt_len].cumsum(-1) - 1).clamp(min=0)
        batch_size = len(prompts) * n
        completion = torch.zeros((batch_size, steps), dtype=torch.long, device=device)
        logprobs = torch.zeros((batch_size, steps), dtype=torch.float32, device=device)
        lengths, stopped = budget.clone(), torch.zeros(batch_size, dtype=torch.bool, device=device)
        active = torch.arange(batch_size, device=device)  # batch row -> completion index
        eos = torch.tensor(self.eos_token_ids, dtype=torch.long, device=device)
        num_layers = self.model.config.get_text_config().num_hidden_layers
        # Each prompt's keys and values once for its n rows (rollout.kv_cache.SharedPrefixCache) where the
        # written-out decode step runs; otherwise copied to the n rows of a preallocated cache.
        shared_prefix = self._step_by_hand and prefix_attention_available(device)
        if shared_prefix:
            cache = SharedPrefixCache(num_layers, steps, n, self._decode_mask(attention_mask[:, :prompt_len]))
        else:
            cache = preallocated_cache(num_layers, prompt_len + steps)
        # The projections reordered for oneDNN once per call (the policy's weights change between calls).
        weights = pack_decode_weights(self._decoder, self._head, batch_size) if self._step_by_hand else None
        with attention_implementation(self.model, self._attention):
            logits = self._next_logits(input_ids, attention_mask[:, :prompt_len], position_ids, cache, weights)
            prefill_rows = torch.arange(len(prompts), device=device).repeat_interleave(n)  # one row per prompt -> n
            if not shared_prefix:
                cache.batch_select_indices(prefill_rows)
            logits, attention_mask = logits[prefill_rows], attention_mask[prefill_rows]
            positions = position_ids[prefill_rows, -1:]
            for step in range(steps):
                if self.num_text_tokens < logits.shape[-1]:
                    logits[:, self.num_text_tokens:] = float("-inf")
                tokens, token_logprobs = sample_next_tokens(
                    logits, temperature=temperature, top_p=top_p, top_k=top_k, generator=generator)
                completion[active, step], logprobs[active, step] = tokens, token_logprobs
                stop = torch.isin(tokens, eos)
                if stop_strings:
                    stop |= self._stop_string_hits(completion[active, : step + 1], stop_strings)
                finished = stop | (budget[active] <= step + 1)
                stopped[active[stop]] = True
                lengths[active[finished]] = step + 1
                if bool(finished.all()):
                    break
                if bool(finished.any()):
                    keep = (~finished).nonzero()[:, 0]
                    cache.batch_select_indices(keep)
                    active, tokens, positions, attention_mask = active[keep], tokens[keep], positions[keep], attention_mask[keep]
                positions = positions + 1
                mask = None if shared_prefix else self._decode_mask(attention_mask[:, : prompt_len + step + 1])
                logits = self._next_logits(tokens[:, None], mask, positions, cache, weights)
        completion_lists, logprob_lists = completion.tolist(), logprobs.tolist()
        results = []
        for index, (length, row_stopped) in enumerate(zip(lengths.tolist(), stopped.tolist())):
            ids = completion_lists[index][:length]
            results.append(Completion(
                prompt_ids=list(prompts[index // n]), completion_ids=ids, text=completion_text(self.tokenizer, ids),
                logprobs=logprob_lists[index][:length], finish_reason="stop" if row_stopped else "length"))
        return results

    def _next_logits(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, cache,
                     weights: DecodeWeights | None) -> Tensor:
        """Run [A, L] new tokens on the cache; return the next-token logits after each row's last one, [A, V].

        A decode step (L = 1) of a supported architecture runs rollout.decode_step (on `weights`, the
        oneDNN-reordered projections, when given); otherwise the decoder's own forward. With a plain linear head
        the last hidden states are projected by the reordered head, or in slices of the vocabulary (`_project`);
        otherwise the model's forward computes the logits of one position."""
        if self._head is None:
            return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1, :]
        if self._step_by_hand and input_ids.shape[1] == 1:
            hidden = decode_step(self._decoder, input_ids, attention_mask, position_ids, cache, weights)
        else:
            hidden = self._decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   past_key_values=cache, use_cache=True).last_hidden_state[:, -1, :]
        if weights is not None:
            return linear(hidden, weights.head, weights.head_bias)
        return _project(hidden, self._head.weight, self._head.bias)

    def _decode_mask(self, attention_mask: Tensor) -> Tensor:
        """The mask of one decode step: [A, S] 0/1 as transformers takes it, or, with our sdpa function, the
        [A, 1, 1, S] additive float mask it would build from that (0 on real columns, -inf on padding), which
        torch's CPU kernel runs faster than the boolean one (bench/README.md, "Decode-step profile")."""
        if self._attention is None:
            return attention_mask
        additive = torch.zeros(attention_mask.shape, dtype=self.model.dtype, device=attention_mask.device)
        return additive.masked_fill_(attention_mask == 0, float("-inf"))[:, None, None, :]

    def _stop_string_hits(self, completions: Tensor, stop_strings: list[str]) -> Tensor:
        """[A] bool: whether each row's decoded completion ([A, k] token ids so far) contains a stop string
        (checked after every token, so the first True is at the token that completed it)."""
        texts = self.tokenizer.batch_decode(completions.tolist(), skip_special_tokens=True)
        hits = [any(stop_string in text for stop_string in stop_strings) for text in texts]
        return torch.tensor(hits, dtype=torch.bool, device=completions.device)

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

    def wake(self, tags: Sequence[str] = ("weights", "kv_cache")) -> None:
        """No-op (see `sleep`)."""

    def close(self) -> None:
        """Nothing to release: the model is the caller's (or garbage once the engine goes)."""


# Vocabulary rows per slice of the output projection during decoding: MKL handles one tall thin [V, H] weight
# poorly, and slices of 2,048 rows run faster (bench/README.md, "Decode-step profile").
HEAD_SLICE_ROWS = 2048


def _project(hidden: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """hidden [A, H] @ weight[V, H].T (+ bias) -> logits [A, V], computed HEAD_SLICE_ROWS vocabulary rows at a
    time (each logit is the same dot product as in one F.linear call)."""
    logits = hidden.new_empty(hidden.shape[0], weight.shape[0])
    for start in range(0, weight.shape[0], HEAD_SLICE_ROWS):
        rows = slice(start, start + HEAD_SLICE_ROWS)
        torch.mm(hidden, weight[rows].t(), out=logits[:, rows])
    return logits if bias is None else logits.add_(bias)
