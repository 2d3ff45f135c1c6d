"""The transformers rollout engine: a sampling loop over a batch of left-padded prompts, for CPU runs and tests.

Why not `model.generate`: the loop needs the logprob of each sampled token under exactly the distribution it
was drawn from, nothing read from the model's generation_config, and finished rows leaving the batch so that
long-tail completions do not pay for short ones. The forward passes: `TransformersDecoding`."""
from __future__ import annotations

from typing import Iterable, Sequence

import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from models.logprobs import evaluating, pad_batch, sampleable_vocab_size
from rollout.engine import Completion, Engine, completion_text, oom_explained, torch_threads, validate_request


class HFEngine(Engine):
    """Generate with a plain (not FSDP-sharded) transformers causal LM. `sleep`, `wake` and `close` are the
    protocol's no-ops: the model has no separate generation memory, and it is the caller's to release.

    shared:        True when `model` is the policy being trained: `update_weights` is then a no-op (the engine
                   already sees every optimizer step). False when the engine owns its copy, updated by name.
    eos_token_ids: token ids that end a completion (finish reason "stop"); default: the tokenizer's eos.
    max_context:   the most tokens a sequence may hold; default: the model's max_position_embeddings.
    num_threads:   torch threads while generating (rollout.engine.torch_threads); None: torch's setting as it is.
    """

    def __init__(self, model: torch.nn.Module, tokenizer, *, shared: bool = True,
                 eos_token_ids: Sequence[int] | None = None, max_context: int | None = None,
                 num_threads: int | None = None):
        sharded = [name for name, parameter in model.named_parameters() if type(parameter).__name__ == "DTensor"]
        if sharded:  # each rank would stop generating at a different step and deadlock in FSDP's all-gathers
            raise ValueError(f"HFEngine needs an unsharded model, but parameter {sharded[0]!r} is an FSDP DTensor: "
                             f"build the engine on a full copy (shared=False) and push weights with "
                             f"rollout.sync.sync_weights")
        self.model = model
        self.tokenizer = tokenizer
        self.shared = shared
        self.num_threads = num_threads
        eos_token_ids = [tokenizer.eos_token_id] if eos_token_ids is None else eos_token_ids
        self.eos_token_ids = sorted(set(int(token) for token in eos_token_ids))
        self.max_context = int(max_context or model.config.max_position_embeddings)
        self.vocab_size = model.get_input_embeddings().weight.shape[0]
        self.num_text_tokens = sampleable_vocab_size(model, tokenizer)  # padded rows have no text: never sampled

    def generate(self, prompts: list[list[int]], *, n: int = 1, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, stop: Sequence[str] | None = None,
                 seed: int | None = None) -> list[Completion]:
        """Sample n completions per prompt (rollout.engine.Engine); the model's train/eval mode is restored after.
        seed: the same seed, prompts and weights give the same completions; None draws one from torch's RNG."""
        stop_strings = validate_request(
            prompts, n=n, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
            stop=stop, seed=seed, max_context=self.max_context, vocab_size=self.vocab_size,
        )
        with (evaluating(self.model), torch.no_grad(), torch_threads(self.num_threads),
              oom_explained(len(prompts) * n, max_new_tokens)):
            return self._sample(prompts, n, max_new_tokens, temperature, top_p, top_k, stop_strings, seed)

    def _sample(self, prompts, n, max_new_tokens, temperature, top_p, top_k, stop_strings, seed) -> list[Completion]:
        """The decoding loop over B = len(prompts) * n rows: each prompt prefilled once for its n rows, then one
        token per row and step; rows that finish leave the batch."""
        device = self.model.get_input_embeddings().weight.device
        generator = torch.Generator(device=device)
        generator.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
        prompt_lengths = torch.tensor([len(prompt) for prompt in prompts]).repeat_interleave(n)
        budget = (self.max_context - prompt_lengths).clamp(max=max_new_tokens).to(device)
        steps = int(budget.max())
        # Prompts left-padded with the trainer's positions (models.logprobs.pad_batch), so their logprobs agree.
        batch = pad_batch(prompts, [[] for _ in prompts], self.tokenizer.pad_token_id)
        input_ids, attention_mask, position_ids = (batch[key].to(device) for key in
                                                   ("input_ids", "attention_mask", "position_ids"))
        batch_size = len(prompts) * n
        completion = torch.zeros((batch_size, steps), dtype=torch.long, device=device)
        logprobs = torch.zeros((batch_size, steps), dtype=torch.float32, device=device)
        lengths, stopped = budget.clone(), torch.zeros(batch_size, dtype=torch.bool, device=device)
        active = torch.arange(batch_size, device=device)  # batch row -> completion index
        eos = torch.tensor(self.eos_token_ids, dtype=torch.long, device=device)
        decoding = TransformersDecoding(self.model, n)
        logits = decoding.prefill(input_ids, attention_mask, position_ids)
        last_positions = position_ids[:, -1:].repeat_interleave(n, dim=0)  # [B, 1]: each row's last prompt position
        for step in range(steps):
            logits[:, self.num_text_tokens:] = float("-inf")
            tokens, token_logprobs = sample_next_tokens(
                logits, temperature=temperature, top_p=top_p, top_k=top_k, generator=generator)
            completion[active, step], logprobs[active, step] = tokens, token_logprobs
            stop = torch.isin(tokens, eos)
            if stop_strings:  # decoded after every token, so a row stops at the token completing a stop string
                texts = self.tokenizer.batch_decode(completion[active, : step + 1].tolist(), skip_special_tokens=True)
                stop |= torch.tensor([any(s in text for s in stop_strings) for text in texts], device=device)
            finished = stop | (budget[active] <= step + 1)
            stopped[active[stop]] = True
            lengths[active[finished]] = step + 1
            if bool(finished.all()):
                break
            if bool(finished.any()):
                keep = (~finished).nonzero()[:, 0]
                decoding.keep(keep)
                active, tokens = active[keep], tokens[keep]
            logits = decoding.step(tokens, last_positions[active] + step + 1)
        rows = zip(completion.tolist(), logprobs.tolist(), lengths.tolist(), stopped.tolist())
        return [Completion(prompt_ids=list(prompts[index // n]), completion_ids=ids[:length],
                           text=completion_text(self.tokenizer, ids[:length]), logprobs=row_logprobs[:length],
                           finish_reason="stop" if row_stopped else "length")
                for index, (ids, row_logprobs, length, row_stopped) in enumerate(rows)]

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Copy HF-named full tensors (parameters, and the persistent buffers models.fsdp.full_state_dict streams
        beside them) into the engine's own model by load_state_dict, which names a tensor of the wrong shape and
        both shapes; a no-op when the engine shares the policy."""
        if self.shared:
            for _ in named_tensors:  # consume the stream: a distributed producer may depend on it
                pass
            return
        unknown = self.model.load_state_dict(dict(named_tensors), strict=False).unexpected_keys
        if unknown:
            raise ValueError(f"update_weights: the engine's model has no parameter named {unknown[0]!r}")


class TransformersDecoding:
    """One generate call's forward passes through the model's own forward on a transformers DynamicCache (any
    architecture, device and attention implementation)."""

    def __init__(self, model: torch.nn.Module, n: int):
        self.model, self.n, self.cache = model, n, DynamicCache(config=model.config)

    def prefill(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor) -> Tensor:
        """The left-padded prompts [P, Lp]; returns the next-token logits of the P * n rows, [P * n, V]."""
        self.attention_mask = attention_mask
        logits = self._forward(input_ids, attention_mask, position_ids)
        rows = torch.arange(len(input_ids), device=input_ids.device).repeat_interleave(self.n)
        self.keep(rows)  # each prompt's keys and values copied to its n rows
        return logits[rows]

    def step(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """The next-token logits [A, V] after each live row's `tokens` [A] at `positions` [A, 1]."""
        self.attention_mask = torch.cat([self.attention_mask, self.attention_mask.new_ones(len(tokens), 1)], dim=1)
        return self._forward(tokens[:, None], self.attention_mask, positions)

    def keep(self, rows: Tensor) -> None:
        """Keep live rows `rows`, in that order (repeats allowed)."""
        self.cache.reorder_cache(rows)
        self.attention_mask = self.attention_mask[rows]

    def _forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor) -> Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          past_key_values=self.cache, use_cache=True, logits_to_keep=1).logits[:, -1]


def truncate_logits(logits: Tensor, top_p: float, top_k: int) -> Tensor:
    """A copy of logits ([A, V] float32, divided by the temperature) with -inf outside the top-k set and outside
    the top-p nucleus, by transformers' warpers: a token goes while the ascending cumulative mass up to it is
    <= 1 - top_p, vLLM's rule. top_k 0 and top_p 1.0 keep everything, and the most likely token always stays."""
    if 0 < top_k < logits.shape[-1]:
        logits = TopKLogitsWarper(top_k)(None, logits)
    return TopPLogitsWarper(top_p)(None, logits) if top_p < 1.0 else logits


def sample_next_tokens(logits: Tensor, *, temperature: float, top_p: float, top_k: int,
                       generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Draw one token per row of logits ([A, V], any float dtype; the maths in float32): (tokens [A] int64,
    logprobs [A] float32), the logprob of log_softmax(logits / temperature) renormalised over the top-k/top-p
    set. Temperature 0 is greedy: argmax, with the logprob of the untempered distribution (as vLLM reports it)."""
    logits = logits.float()
    if temperature == 0:
        tokens = logits.argmax(dim=-1)
        return tokens, logits.log_softmax(dim=-1).gather(-1, tokens[:, None])[:, 0]
    processed = truncate_logits(logits / temperature if temperature != 1.0 else logits, top_p, top_k)
    processed_logprobs = processed.log_softmax(dim=-1)
    tokens = draw_from_probabilities(processed_logprobs.exp(), generator)
    return tokens, processed_logprobs.gather(-1, tokens[:, None])[:, 0]


def draw_from_probabilities(probabilities: Tensor, generator: torch.Generator) -> Tensor:
    """One index per row of probabilities ([A, V] >= 0, each row with a positive sum), drawn with probability
    proportional to its entry by inverse-CDF sampling: [A] int64. torch.multinomial draws V exponential variates
    per row, a large share of a CPU decode step; this draws one float64 uniform. The cumulative sum is in float64
    so that a token of probability 1e-9 next to a mass of 0.5 keeps its share; a zero-probability index is never
    returned (the first index whose cumulative sum exceeds u * total is one where the sum grew)."""
    cumulative = probabilities.double().cumsum(dim=-1)
    total = cumulative[:, -1:]
    uniform = torch.rand(total.shape, dtype=torch.float64, generator=generator, device=probabilities.device)
    # u < 1, but u * total can round up to total: keep the target strictly below it.
    target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cumulative, target, right=True)[:, 0]
