"""The ViT workload's batch streams over an ERA5Dataset: one data-parallel rank's endless training stream, the same
samples per optimizer step in every layout, and evaluation batches that count every sample of a split (or of its
first `limit`) exactly once over the ranks.

Both shard over the data-parallel ranks only (tp/cp ranks of one replica pass the same dp_rank and read the same
batches) and use samplers of their own random generator, so building a loader never draws from the global RNG
that drives dropout.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from meshtrain.data.text import DataError

CPU = torch.device("cpu")


def check_sharding(batch_size: int, dp_rank: int, dp_size: int, num_workers: int) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank must lie in [0, dp_size={dp_size}), got {dp_rank}")
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")


def _describe(dataset: Dataset) -> str:
    split, root = getattr(dataset, "split", None), getattr(dataset, "root", None)
    return f"the {split} split of {root}" if split and root else "the dataset"


def _on_device(host_batches, device: torch.device) -> Iterator[tuple[torch.Tensor, ...]]:
    """The batches (tuples of CPU tensors) of `host_batches`, moved to `device`.

    On CUDA the generator stays one batch ahead: when it hands out batch i it has already started the copy
    of batch i + 1 on a side stream, so that copy runs while the caller computes with batch i. The caller's
    stream waits for the copy of the batch it takes (the event), and record_stream tells the allocator that
    memory allocated on the side stream is in use on the caller's, so it is not reused too early. Copies from
    pinned host memory are asynchronous; torch keeps the pinned buffer until its copy has finished.
    """
    if device.type != "cuda":
        for batch in host_batches:
            yield tuple(t.to(device) for t in batch)
        return
    side = torch.cuda.Stream(device)

    def start_copy(batch):
        with torch.cuda.stream(side):
            moved = tuple(t.to(device, non_blocking=True) for t in batch)
            copied = torch.cuda.Event()
            copied.record(side)
        return moved, copied

    def hand_over(moved, copied):
        current = torch.cuda.current_stream(device)
        current.wait_event(copied)
        for t in moved:
            t.record_stream(current)
        return moved

    ahead = None
    for batch in host_batches:
        following = start_copy(batch)
        if ahead is not None:
            yield hand_over(*ahead)
        ahead = following
    if ahead is not None:
        yield hand_over(*ahead)


class GlobalBatchOrder:
    """Which samples global batch i (one optimizer step) holds, and which of them each rank's micro-step takes: a
    function of the seed and i alone, so that every layout with the same global batch reads the same samples.

    Epoch e shuffles the split by seed + e (DistributedSampler's permutation); global batch i is the
    (i mod steps_per_epoch)-th run of global_batch positions of epoch i // steps_per_epoch (a tail that fills no
    global batch is dropped, no sample is read twice in an epoch); micro-step a of dp rank r takes its rows from
    (a × dp_size + r) × batch_size on. Picklable (DALI's workers each get a copy)."""

    def __init__(self, num_samples: int, *, batch_size: int, dp_rank: int, dp_size: int, accum: int, seed: int):
        self.num_samples, self.batch_size, self.accum, self.seed = num_samples, batch_size, accum, seed
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.global_batch = batch_size * dp_size * accum
        self.steps_per_epoch = num_samples // self.global_batch
        self._permutation: tuple[int, torch.Tensor] | None = None

    def global_ids(self, step: int) -> list[int]:
        """The samples of global batch `step`, all ranks'."""
        epoch, within = divmod(step, self.steps_per_epoch)
        if self._permutation is None or self._permutation[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._permutation = (epoch, torch.randperm(self.num_samples, generator=generator))
        return self._permutation[1][within * self.global_batch:(within + 1) * self.global_batch].tolist()

    def rank_ids(self, step: int) -> list[int]:
        """This rank's samples of global batch `step`, in the order of its micro-steps."""
        ids, b = self.global_ids(step), self.batch_size
        return [i for a in range(self.accum) for i in ids[(a * self.dp_size + self.dp_rank) * b:][:b]]


class _RestOfEpoch(Sampler):
    """This rank's samples from global batch `start` to the end of its epoch, micro-batch after micro-batch."""

    def __init__(self, order: GlobalBatchOrder):
        self.order, self.start = order, 0

    def _end(self) -> int:
        return (self.start // self.order.steps_per_epoch + 1) * self.order.steps_per_epoch

    def __iter__(self):
        for step in range(self.start, self._end()):
            yield from self.order.rank_ids(step)

    def __len__(self) -> int:
        return (self._end() - self.start) * self.order.accum * self.order.batch_size


class ERA5Batches:
    """One data-parallel rank's endless training stream: next_batch() -> (x, y) on `device`, [B, C, H, W].

    The samples come in GlobalBatchOrder: the position is the global batch number alone (`seek`), so a run resumed
    at iteration i, in any layout with the same global batch, reads what the uninterrupted run read there. The
    DataLoader gets a generator of its own, so drawing batches never advances torch's global RNG (dropout stays
    reproducible). On CUDA: pinned host memory and the next batch copied on a side stream while this one computes.
    close() stops the worker processes; the stream restarts them if used again.
    """

    def __init__(self, dataset: Dataset, *, batch_size: int, dp_rank: int = 0, dp_size: int = 1, accum: int = 1,
                 seed: int = 0, device: torch.device | str = CPU, num_workers: int = 0, pin_memory: bool | None = None,
                 persistent_workers: bool = True, prefetch_factor: int = 2):
        check_sharding(batch_size, dp_rank, dp_size, num_workers)
        self.order = GlobalBatchOrder(len(dataset), batch_size=batch_size, dp_rank=dp_rank, dp_size=dp_size,
                                      accum=accum, seed=seed)
        self.batch_size, self.dp_rank, self.dp_size, self.accum, self.seed = batch_size, dp_rank, dp_size, accum, seed
        self.steps_per_epoch = self.order.steps_per_epoch  # global batches (iterations) per epoch
        if self.steps_per_epoch == 0:
            raise DataError(f"{_describe(dataset)} has {len(dataset)} samples, too few for one training step: a "
                            f"global batch of dp_size={dp_size} ranks x batch_size={batch_size} x grad_accum={accum} "
                            f"needs {self.order.global_batch}. Lower the batch (or the data-parallel size), or use "
                            "more data (a larger limit or more years)")
        self.device = torch.device(device)
        self.sampler = _RestOfEpoch(self.order)
        worker_options = {}
        if num_workers > 0:
            worker_options = {"persistent_workers": persistent_workers, "prefetch_factor": prefetch_factor}
        self.loader = DataLoader(dataset, batch_size=batch_size, sampler=self.sampler, num_workers=num_workers,
                                 pin_memory=self.device.type == "cuda" if pin_memory is None else pin_memory,
                                 drop_last=True, generator=torch.Generator().manual_seed(seed), **worker_options)
        self.step, self.micro = 0, 0  # where the next batch comes from: global batch `step`, micro-step `micro`
        self._batches = None  # built on the next next_batch(), from the position above

    def _host_batches(self, step: int):
        while True:
            self.sampler.start = step
            yield from self.loader
            step = (step // self.steps_per_epoch + 1) * self.steps_per_epoch

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._batches is None:
            self._batches = _on_device(self._host_batches(self.step), self.device)
        x, y = next(self._batches)
        self.micro += 1
        if self.micro == self.accum:
            self.step, self.micro = self.step + 1, 0
        return x, y

    def seek(self, step: int) -> None:
        """Start the next batch at global batch `step`, micro-step 0 (drops a batch fetched ahead)."""
        self.step, self.micro, self._batches = int(step), 0, None

    def global_ids(self, step: int) -> list[int]:
        """The samples (dataset indices) of global batch `step`, all ranks'."""
        return self.order.global_ids(step)

    def close(self) -> None:
        """Stop the worker processes (they linger with persistent_workers) and drop any batch fetched ahead."""
        self._batches = None
        iterator = getattr(self.loader, "_iterator", None)  # DataLoader keeps persistent workers' iterator here
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
        self.loader._iterator = None

    def __enter__(self) -> ERA5Batches:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------- an exact evaluation pass


class _PaddedDeal(Sampler):
    """Rank dp_rank's (index, weight) pairs of one evaluation pass.

    Sample i goes to rank i % dp_size, in order, as DistributedSampler(shuffle=False) deals; the deal goes on
    round the dataset again, with weight 0, until every rank holds num_batches full batches. So all ranks run
    the same number of equally shaped batches (their collectives line up, a pipeline splits each batch alike)
    and every sample carries total weight exactly 1; the padding is fewer than dp_size * batch_size samples.
    """

    def __init__(self, num_samples: int, *, batch_size: int, dp_rank: int, dp_size: int):
        self.num_samples, self.dp_rank, self.dp_size = num_samples, dp_rank, dp_size
        self.num_batches = -(-num_samples // (dp_size * batch_size))
        self.per_rank = self.num_batches * batch_size

    def __iter__(self):
        for position in range(self.dp_rank, self.per_rank * self.dp_size, self.dp_size):
            yield position % self.num_samples, float(position < self.num_samples)

    def __len__(self) -> int:
        return self.per_rank


class _Weighted(Dataset):
    """dataset[index] with its weight: item (index, weight) -> (x, y, weight as a 0-dim float32 tensor)."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item: tuple[int, float]):
        index, weight = item
        x, y = self.dataset[index]
        return x, y, torch.tensor(weight, dtype=torch.float32)


class EvalBatches:
    """One dp rank's evaluation pass, iterable again for every evaluation: (x, y, weight) on the device.

    weight [B] is 1.0 for a real sample and 0.0 for padding, so sum(weight * metric) / sum(weight), both sums
    reduced over the dp ranks, is the exact mean over the split. len() is the number of batches, equal on
    every rank. Worker processes, if any, live for one pass.
    """

    def __init__(self, dataset: Dataset, *, batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 device: torch.device | str = CPU, num_workers: int = 0, pin_memory: bool | None = None,
                 limit: int | None = None):
        check_sharding(batch_size, dp_rank, dp_size, num_workers)
        if len(dataset) == 0:
            raise DataError(f"{_describe(dataset)} has no samples to evaluate on: point the evaluation at a "
                            "split with data")
        self.device = torch.device(device)
        counted = len(dataset) if limit is None else min(len(dataset), limit)  # the first `limit` samples
        self.sampler = _PaddedDeal(counted, batch_size=batch_size, dp_rank=dp_rank, dp_size=dp_size)
        self.loader = DataLoader(_Weighted(dataset), batch_size=batch_size, sampler=self.sampler,
                                 num_workers=num_workers, generator=torch.Generator(),
                                 pin_memory=self.device.type == "cuda" if pin_memory is None else pin_memory)

    def __len__(self) -> int:
        return self.sampler.num_batches

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        return _on_device(self.loader, self.device)


def eval_batches(dataset: Dataset, *, batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 device: torch.device | str = CPU, num_workers: int = 0, pin_memory: bool | None = None,
                 limit: int | None = None) -> EvalBatches:
    """This dp rank's exact evaluation pass over `dataset` (its first `limit` samples): see EvalBatches."""
    return EvalBatches(dataset, batch_size=batch_size, dp_rank=dp_rank, dp_size=dp_size, device=device,
                       num_workers=num_workers, pin_memory=pin_memory, limit=limit)
