"""The one batch layout of every logprob and training pass: prompts left-padded, completions right-padded, so
that every completion starts at the same column and the logits at column Lp-1+t predict completion token t."""
from __future__ import annotations

from collections.abc import Sequence

import torch


def pad_batch(prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]], pad_id: int) -> dict:
    """Lay out B (prompt, completion) pairs as one padded batch.

    prompt_ids:     B lists of prompt token ids (each non-empty).
    completion_ids: B lists of completion token ids (may be empty).
    Returns a dict of CPU tensors:
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
        raise ValueError(f"pad_batch got {len(prompt_ids)} prompts but {len(completion_ids)} completions; pass one per prompt")
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
        start = prompt_len - len(prompt)
        input_ids[row, start:prompt_len] = torch.as_tensor(list(prompt), dtype=torch.long)
        attention_mask[row, start:prompt_len] = 1
        if len(completion):
            input_ids[row, prompt_len : prompt_len + len(completion)] = torch.as_tensor(list(completion), dtype=torch.long)
            attention_mask[row, prompt_len : prompt_len + len(completion)] = 1
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    completion_mask = attention_mask[:, prompt_len:].to(torch.float32)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "completion_mask": completion_mask,
        "prompt_len": prompt_len,
    }
