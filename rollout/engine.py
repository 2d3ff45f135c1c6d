"""The rollout interface every generation engine implements (the `Completion` record, the `Engine` protocol) and
the request checks and text rule they share, so that all engines fail and decode identically.

Text rule: `completion.text == tokenizer.decode(completion.completion_ids, skip_special_tokens=True)`. A completion
stopped by a stop string keeps the token that completed it (the policy must learn to emit it), so the text holds
the stop string and runs past it only when that token does (stop "\\n" completed by a "\\n\\n" token). A completion
stopped by an end-of-sequence token keeps that token in `completion_ids` (its logprob is trained), not in `text`."""
from __future__ import annotations

import hashlib
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, Protocol, Sequence, runtime_checkable

import torch
from torch import Tensor


@dataclass
class Completion:
    """One sampled completion of one prompt."""

    prompt_ids: list[int]
    completion_ids: list[int]  # [T] the sampled token ids, end-of-sequence or stop-completing token included
    text: str  # decode(completion_ids, skip_special_tokens=True): the module docstring's text rule
    # [T] log-probability of each token under the distribution it was sampled from: log_softmax(logits /
    # temperature), renormalised over the top-k/top-p set when those truncate (the trainer's temperature-only
    # recomputation then differs by the log of the kept mass); with temperature 0 (greedy), log_softmax(logits).
    logprobs: list[float]
    finish_reason: str  # "stop" (end-of-sequence token or stop string) or "length" (max_new_tokens or the context)
    # Multi-turn trajectories (rollout/tools.py): [T] 1 on the model's tokens, 0 on the tool messages' (logprob 0);
    # None: every token is the model's. tool_stats: the trajectory's "turns", "calls", and calls by status ("ok",
    # "error", "timeout": rollout.tools.run_calls).
    mask: list[int] | None = None
    tool_stats: dict[str, int] | None = None


@runtime_checkable
class Engine(Protocol):
    """What the training loop needs from a generation backend (HFEngine, VLLMEngine)."""

    def generate(self, prompts: list[list[int]], *, n: int, max_new_tokens: int, temperature: float, top_p: float,
                 top_k: int, stop: Sequence[str] | None, seed: int | None) -> list[Completion]:
        """Sample n completions per prompt: B = len(prompts) * n, the n completions of a prompt consecutive."""

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Load HF-named full tensors (any subset of the model's parameters) into the engine's model."""

    def sleep(self) -> None:
        """Free generation memory (weights and KV cache) until `wake`; a no-op where the backend cannot."""

    def wake(self, tags: Sequence[str] = ("weights", "kv_cache")) -> None:
        """Restore `tags` of what `sleep` freed ("weights" before a sync, "kv_cache" after it)."""

    def close(self) -> None:
        """Release the engine at the end of a run."""


SEED_BITS = 63  # seeds are non-negative int64 (torch.Generator.manual_seed and vLLM both take them)
CHILD_BITS = 16  # the low bits vLLM adds a completion's index to (prompt_seed)


def stream_seed(*parts: int) -> int:
    """A seed for a random stream named by integers, e.g. (run seed, step, replica, round): a hash, so streams of
    different names are unrelated (seed + step would make one name another shifted by one) and collide with
    probability 2^-63 per pair.

    >>> stream_seed(0, 1) == stream_seed(0, 1) != stream_seed(1, 0)
    True
    """
    digest = hashlib.blake2b(b",".join(str(int(part)).encode() for part in parts), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - SEED_BITS)


def prompt_seed(seed: int, prompt_index: int) -> int:
    """The seed of prompt `prompt_index` in a request seeded `seed`, for engines that give the i-th of a
    prompt's n completions the seed + i (vLLM): a fresh stream per prompt with its low CHILD_BITS bits zero,
    so the n <= 2^16 children of two prompts (or of two calls) never share a seed."""
    return (stream_seed(seed, prompt_index) >> CHILD_BITS) << CHILD_BITS


def validate_request(prompts: list[list[int]], *, n: int, max_new_tokens: int, temperature: float, top_p: float,
                     top_k: int, stop: Sequence[str] | None, seed: int | None, max_context: int,
                     vocab_size: int) -> list[str]:
    """Check one `generate` request before any generation, raising ValueError that names the argument, prompt or
    value (a sequence holds at most max_context tokens, ids lie in [0, vocab_size)); return the stop strings."""
    if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
        raise ValueError(f"prompts must be a non-empty list of token-id lists, got {prompts!r:.80}")
    if not isinstance(n, int) or not 1 <= n <= 2**CHILD_BITS:  # prompt_seed gives each prompt 2^16 child seeds
        raise ValueError(f"n (completions per prompt) must be an integer >= 1, got {n!r} (and at most 2^{CHILD_BITS})")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not temperature >= 0:  # also rejects NaN
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must lie in (0, 1] (1 keeps the whole vocabulary), got {top_p!r}")
    if not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 keeps the whole vocabulary), got {top_k!r}")
    if seed is not None and not (isinstance(seed, int) and 0 <= seed < 2**SEED_BITS):
        raise ValueError(f"seed must be None or an integer >= 0, got {seed!r} (and below 2^{SEED_BITS})")
    if isinstance(stop, str):
        raise ValueError(f"stop must be a list of strings, not a single string: use [{stop!r}]")
    stop_strings = list(stop or [])
    for index, stop_string in enumerate(stop_strings):
        if not isinstance(stop_string, str) or stop_string == "":
            raise ValueError(f"stop[{index}] must be a non-empty string, got {stop_string!r}")
    for index, prompt in enumerate(prompts):
        if not isinstance(prompt, (list, tuple)) or len(prompt) == 0:
            raise ValueError(f"prompt {index} must be a non-empty list of token ids, got {prompt!r:.80}")
        if len(prompt) >= max_context:
            raise ValueError(f"prompt {index} has {len(prompt)} tokens but the context holds {max_context}: no new "
                             f"token fits; shorten the prompt or raise the engine's context length")
        bad = min(prompt) if min(prompt) < 0 else max(prompt)
        if not 0 <= bad < vocab_size:
            raise ValueError(f"prompt {index} holds token id {bad}, outside the vocabulary [0, {vocab_size})")
    return stop_strings


def completion_text(tokenizer, completion_ids: Sequence[int]) -> str:
    """The text rule shared by every engine (see the module docstring)."""
    return tokenizer.decode(list(completion_ids), skip_special_tokens=True)


@contextmanager
def oom_explained(batch_size: int, max_new_tokens: int):
    """Re-raise generation's out of memory (CUDA's OutOfMemoryError, the CPU's RuntimeError) with what to do."""
    try:
        yield
    except RuntimeError as error:
        message = str(error).lower()
        if type(error).__name__ == "OutOfMemoryError" or "out of memory" in message or "can't allocate" in message:
            raise type(error)(
                f"out of memory while generating {batch_size} sequences of up to {max_new_tokens} new tokens: "
                f"pass fewer prompts per generate call (or a smaller n / max_new_tokens), or give the engine more "
                f"memory (vLLM: kv_cache_memory_bytes / gpu_memory_utilization). Original error: {error}"
            ) from error
        raise


@contextmanager
def torch_threads(num_threads: int | None):
    """Run an engine call at `num_threads` torch threads (None: as they are), then restore the caller's count and
    `torch.set_num_threads` (an in-process vLLM CPU worker replaces it with a no-op). Token-by-token decoding is many
    small parallel regions that on a busy CPU wait for descheduled OpenMP workers: one thread can be much faster."""
    set_num_threads, caller_threads = torch.set_num_threads, torch.get_num_threads()
    set_num_threads(caller_threads if num_threads is None else num_threads)
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        set_num_threads(caller_threads)
