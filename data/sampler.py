"""The order in which a rank reads training rows: seeded epoch-wise shuffles, each rank its own stride, so that
every rank owns whole groups and no collective is needed for advantages. Used by the SFT and RL loops."""
from __future__ import annotations

import torch


class PromptSampler:
    """Seeded epoch-wise shuffling of row indices; each rank reads its own stride (whole groups per rank).

    `position` (prompts consumed by this rank) is all the state a resumed run needs.
    """

    def __init__(self, num_rows: int, *, seed: int, rank: int = 0, world_size: int = 1, shuffle: bool = True):
        if num_rows < world_size:
            raise ValueError(f"{num_rows} training rows cannot feed {world_size} ranks")
        self.num_rows, self.seed, self.rank, self.world_size, self.shuffle = num_rows, seed, rank, world_size, shuffle
        self.position = 0

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_rows))
        return torch.randperm(self.num_rows, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()

    def next(self, count: int) -> list[int]:
        per_epoch = self.num_rows // self.world_size
        out = []
        for _ in range(count):
            epoch, offset = divmod(self.position, per_epoch)
            out.append(self._order(epoch)[offset * self.world_size + self.rank])
            self.position += 1
        return out
