"""Deal an epoch's samples out window by window, in the batch counts ElChe chose.

Every rank builds the same shuffled permutation of the epoch (seeded by ``seed`` and the
epoch number) and keeps the same cursor into it. A window with counts ``[c0, c1, ...]``
takes the next ``sum(counts) * batch_size`` samples: rank 0 the first ``c0`` batches, rank 1
the next ``c1``, and so on. Slices never overlap, so no sample is seen twice in an epoch, and
each rank gets exactly its count. Ranks agree on the cursor because they agree on the counts
(every rank computes them from the same exchanged timings).

Batches are full: the epoch's last ``dataset_size % batch_size`` samples (a different few
each epoch, since the order is shuffled) wait for the next epoch, like ``drop_last=True``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from muster.errors import UserError


class WindowSampler:
    """Index batches for one rank, window by window, over shuffled epochs."""

    def __init__(
        self,
        dataset_size: int,
        batch_size: int,
        *,
        rank: int,
        world: int,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        if batch_size < 1:
            raise UserError(f"batch_size must be at least 1, got {batch_size}")
        if dataset_size < batch_size:
            raise UserError(
                f"dataset_size ({dataset_size}) is smaller than one batch ({batch_size}): "
                "use a smaller batch_size"
            )
        if not 0 <= rank < world:
            raise UserError(f"rank {rank} is outside a world of {world}")
        self.dataset_size = dataset_size
        self.batch_size = batch_size
        self.rank = rank
        self.world = world
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = -1
        self._order = torch.arange(dataset_size)
        self._cursor = 0

    @property
    def batches_per_epoch(self) -> int:
        return self.dataset_size // self.batch_size

    @property
    def remaining_batches(self) -> int:
        """Full batches left in this epoch, across all ranks."""
        return (self.dataset_size - self._cursor) // self.batch_size

    def start_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self._cursor = 0
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._order = torch.randperm(self.dataset_size, generator=generator)

    def deal(self, counts: Sequence[int]) -> list[torch.Tensor]:
        """This rank's batches (index tensors) for a window of ``counts``; moves the cursor."""
        if len(counts) != self.world:
            raise UserError(f"expected {self.world} batch counts, got {len(counts)}")
        if any(c < 0 for c in counts):
            raise UserError(f"batch counts must not be negative: {list(counts)}")
        if sum(counts) > self.remaining_batches:
            raise UserError(
                f"a window of {sum(counts)} batches does not fit the {self.remaining_batches} "
                "left in the epoch"
            )
        start = self._cursor + sum(counts[: self.rank]) * self.batch_size
        mine = [
            self._order[start + i * self.batch_size : start + (i + 1) * self.batch_size]
            for i in range(counts[self.rank])
        ]
        self._cursor += sum(counts) * self.batch_size
        return mine
