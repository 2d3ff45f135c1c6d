"""Token-to-sentence alignment: map sentence-level rewards (character spans) onto completion tokens, each token to
the sentence that contains its midpoint. Token spans come from incremental decoding (the text of ids[:k+1] minus
that of ids[:k]), which tiles the decoded text exactly for every tokenizer, unlike decoding tokens one at a time
(SentencePiece drops a lone token's leading-space marker, byte-level BPE splits characters across tokens)."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def token_char_spans(prefix_texts: Sequence[str]) -> list[tuple[int, int]]:
    """Character span of each token from the T + 1 decoded prefixes of its completion, prefix_texts[k] =
    decode(ids[:k]). Returns T spans (start, end) that tile [0, len(prefix_texts[-1])) in order; a token that
    completes only part of a character (byte-level BPE) gets an empty span or the character's span.

    >>> token_char_spans(["", "Hello", "Hello world", "Hello world."])
    [(0, 5), (5, 11), (11, 12)]
    """
    total = len(prefix_texts[-1])
    spans, start = [], 0
    for text in prefix_texts[1:]:
        # A partial UTF-8 character decodes to U+FFFD and can shrink the prefix later: keep spans monotone.
        end = min(max(start, len(text)), total)
        spans.append((start, end))
        start = end
    return spans


def _as_spans(spans, name: str) -> Tensor:
    tensor = torch.as_tensor(spans, dtype=torch.long)
    if tensor.numel() == 0:
        return tensor.reshape(0, 2)
    if tensor.ndim != 2 or tensor.shape[1] != 2:
        raise ValueError(f"{name} must be a list of (start, end) pairs / [N, 2], got shape {tuple(tensor.shape)}")
    if bool((tensor[:, 1] < tensor[:, 0]).any()):
        raise ValueError(f"{name} has a span with end < start")
    return tensor


def token_sentence_index(token_char_spans, sentence_char_spans) -> Tensor:
    """Index [T] long of the sentence containing each token's midpoint, from T token and S sentence spans
    (start, end), end exclusive, sentences not overlapping; -1 for a token with an empty span (special tokens) or
    outside every sentence (tags, whitespace).

    >>> token_sentence_index([(0, 3), (3, 7), (7, 8), (8, 12)], [(0, 7), (8, 12)])
    tensor([ 0,  0, -1,  1])
    """
    tokens = _as_spans(token_char_spans, "token_char_spans")
    sentences = _as_spans(sentence_char_spans, "sentence_char_spans")
    if sentences.shape[0] == 0 or tokens.shape[0] == 0:
        return torch.full((tokens.shape[0],), -1, dtype=torch.long)
    twice_mid = (tokens[:, 0] + tokens[:, 1])[:, None]  # 2 * midpoint, to stay in integers
    inside = (2 * sentences[None, :, 0] <= twice_mid) & (twice_mid < 2 * sentences[None, :, 1])  # [T, S]
    inside &= (tokens[:, 1] > tokens[:, 0])[:, None]
    index = inside.to(torch.long).argmax(dim=1)  # first containing sentence
    return torch.where(inside.any(dim=1), index, torch.full_like(index, -1))


def sentence_shaping(index: Tensor, sentence_rewards, coef: float = 1.0) -> Tensor:
    """Per-token shaping [T] float32 coef * r_sent(token's sentence), 0 where index [T] is -1: a token_shaping row."""
    rewards = torch.as_tensor(sentence_rewards, dtype=torch.float32).reshape(-1)
    if index.numel() and int(index.max()) >= rewards.shape[0]:
        raise ValueError(f"index refers to sentence {int(index.max())} but only {rewards.shape[0]} rewards given")
    padded = torch.cat([rewards, rewards.new_zeros(1)])  # index -1 -> the trailing 0
    return coef * padded[index]
