"""How token ids are stored in the corpus index's 16-bit token stream, with no cap on the number of ids.

infini-gram's builder has a 32-bit token mode, but its suffix-array step allocates 2^32 eight-byte counting
bins (32 GiB) whatever the corpus size (bench/README.md, "Other one-off measurements"). So the index stays
16-bit and ids that do not fit one token take two:

    "u16"    every id is one token (ids 0..MAX_SINGLE_ID); one separator token 0xFFFF per document.
    "u16x2"  every id v is the pair (1 + v // LOW_IDS, HIGH_IDS + 1 + v % LOW_IDS): the first token lies in
             [1, HIGH_IDS], the second in [HIGH_IDS + 1, MAX_SINGLE_ID], so a phrase's token pattern can only
             match at the start of a pair and the suffix array finds exact phrases; two separator tokens per
             document, so every document start, word and window is exactly twice its "u16" position and
             position // 2 is the id's position (what rewards.cooccurrence counts in).

The builder picks "u16" when every id fits and "u16x2" otherwise, up to MAX_PAIR_ID (over a billion ids);
beyond that the build fails naming the number. No stored token has 0xFF as its high byte (ids stop at
0xFEFF), so infini-gram's byte-level search for the separator 0xFFFF (its document-boundary check in
count_cnf) can only match real separators.
"""
from __future__ import annotations

import numpy as np

SEPARATOR_ID = 0xFFFF
MAX_SINGLE_ID = 0xFEFF
HIGH_IDS = 32_639
LOW_IDS = MAX_SINGLE_ID - HIGH_IDS  # 32,640
MAX_PAIR_ID = HIGH_IDS * LOW_IDS - 1  # 1,065,336,959
TOKENS_PER_ID = {"u16": 1, "u16x2": 2}


def choose_layout(largest_id: int, where: str = "the corpus") -> str:
    """"u16" when `largest_id` fits one token, else "u16x2"; ValueError naming the id beyond MAX_PAIR_ID.

    >>> choose_layout(65_279), choose_layout(65_280), choose_layout(1_065_336_959)
    ('u16', 'u16x2', 'u16x2')
    """
    if largest_id <= MAX_SINGLE_ID:
        return "u16"
    if largest_id <= MAX_PAIR_ID:
        return "u16x2"
    raise ValueError(f"{where} has token id {largest_id:,}, beyond the largest id the index stores, {MAX_PAIR_ID:,} "
                     f"(two 16-bit tokens per id)")


def stored_tokens(ids: np.ndarray, layout: str) -> np.ndarray:
    """[N] int ids (0..MAX_PAIR_ID, or 0..MAX_SINGLE_ID for "u16") -> [N * TOKENS_PER_ID[layout]] uint16.

    >>> stored_tokens(np.array([5, 32_640, 70_000]), "u16x2").tolist()
    [1, 32645, 2, 32640, 3, 37360]
    """
    ids = np.asarray(ids, dtype=np.int64)
    if layout == "u16":
        return ids.astype(np.uint16)
    pairs = np.stack([1 + ids // LOW_IDS, HIGH_IDS + 1 + ids % LOW_IDS], axis=1)
    return pairs.reshape(-1).astype(np.uint16)


def separator(layout: str) -> bytes:
    """The bytes that open every document in the token stream."""
    return np.full(TOKENS_PER_ID[layout], SEPARATOR_ID, dtype=np.uint16).tobytes()


def storable(ids: list[int], layout: str) -> bool:
    """Whether every id can be stored in `layout` (an id beyond it never occurs in the index)."""
    return min(ids) >= 0 and max(ids) <= (MAX_SINGLE_ID if layout == "u16" else MAX_PAIR_ID)
