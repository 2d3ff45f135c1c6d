"""The one batch layout of every logprob and training pass: prompts left-padded, completions right-padded, so
that every completion starts at the same column and the logits at column Lp-1+t predict completion token t."""
from __future__ import annotations

from collections.abc import Sequence

import torch


def pad_batch(prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]], pad_id: int) -> dict:
    """Lay out B (prompt, completion) token-id lists, prompts non-empty, as one padded batch of CPU tensors:
      input_ids       [B, Lp+T] long: prompt LEFT-padded to Lp (longest prompt), completion RIGHT-padded to T
      attention_mask  [B, Lp+T] long: 1 on real tokens, 0 on padding
      position_ids    [B, Lp+T] long: (cumsum(attention_mask) - 1).clamp(min=0), so each row starts at 0
      completion_mask [B, T] float: 1.0 on real completion tokens, 0.0 on padding
      prompt_len      int: Lp

    >>> batch = pad_batch([[5, 6], [7]], [[8], [9, 10]], pad_id=0)
    >>> batch["input_ids"].tolist()
    [[5, 6, 8, 0], [0, 7, 9, 10]]
    >>> batch["position_ids"].tolist()
    [[0, 1, 2, 2], [0, 0, 1, 2]]
    >>> batch["completion_mask"].tolist(), batch["prompt_len"]
    ([[1.0, 0.0], [1.0, 1.0]], 2)
    """
    if len(prompt_ids) == 0:
        raise ValueError("pad_batch needs at least one sequence; got an empty list of prompts")
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"pad_batch got {len(prompt_ids)} prompts but {len(completion_ids)} completions; "
                         "pass one per prompt")
    if isinstance(pad_id, bool) or not isinstance(pad_id, int):
        raise ValueError(f"pad_id must be an int token id, got {pad_id!r}")
    for index, prompt in enumerate(prompt_ids):
        if len(prompt) == 0:
            # The first completion token is predicted from the last prompt position, so it must exist.
            raise ValueError(f"prompt {index} is empty; every prompt needs at least one token")
    batch_size = len(prompt_ids)
    prompt_len = max(len(prompt) for prompt in prompt_ids)
    completion_len = max(len(completion) for completion in completion_ids)
    input_ids = torch.full((batch_size, prompt_len + completion_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((batch_size, prompt_len + completion_len), dtype=torch.long)
    for row, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids)):
        columns = slice(prompt_len - len(prompt), prompt_len + len(completion))
        input_ids[row, columns] = torch.as_tensor([*prompt, *completion], dtype=torch.long)
        attention_mask[row, columns] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp(min=0),
            "completion_mask": attention_mask[:, prompt_len:].to(torch.float32), "prompt_len": prompt_len}


def micro_batches_by_tokens(lengths: Sequence[int], max_tokens: int, *, min_count: int = 1) -> list[list[int]]:
    """Split sequences of the given token lengths into as few micro-batches of at most `max_tokens` tokens each
    as the budget allows, the tokens spread evenly over them; returns lists of sequence indices, each ascending,
    ordered by their first index. min_count: the least number of micro-batches (the largest count any rank needs:
    FSDP's collectives pair up across ranks); the extra ones are empty lists, run as zero-weight passes.
    How: k = max(ceil(total / max_tokens), min_count) batches, longest sequence first into the least loaded one
    with room (ties to the lower one: the plan is deterministic); if one fits nowhere, k grows by one.

    >>> micro_batches_by_tokens([5, 1, 4, 3, 2, 9], max_tokens=10)
    [[0, 1, 4], [2, 3], [5]]
    """
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
    for index, length in enumerate(lengths):
        if isinstance(length, bool) or not isinstance(length, int) or length < 0:
            raise ValueError(f"lengths[{index}] must be a token count >= 0, got {length!r}")
        if length > max_tokens:
            raise ValueError(f"sequence {index} has {length} tokens, more than the micro-batch token budget "
                             f"max_tokens={max_tokens}: raise the budget or shorten the sequence")
    order = sorted(range(len(lengths)), key=lambda index: (-lengths[index], index))
    count = max(-(-sum(lengths) // max_tokens), min_count, 1)
    while True:
        loads, batches = [0] * count, [[] for _ in range(count)]
        for index in order:
            open_batches = [b for b in range(count) if loads[b] + lengths[index] <= max_tokens]
            if not open_batches:
                break
            target = min(open_batches, key=lambda b: (loads[b], b))
            loads[target] += lengths[index]
            batches[target].append(index)
        else:
            filled = sorted((sorted(batch) for batch in batches if batch), key=lambda batch: batch[0])
            return filled + [[] for _ in range(count - len(filled))]
        count += 1
