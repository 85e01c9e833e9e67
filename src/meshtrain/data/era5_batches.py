"""The ViT workload's batch streams over an ERA5Dataset: one data-parallel rank's endless, resumable training
stream, and evaluation batches that count every sample of a split exactly once over the ranks.

Both shard over the data-parallel ranks only (tp/cp ranks of one replica pass the same dp_rank and read the same
batches) and use samplers of their own random generator, so building a loader never draws from the global RNG
that drives dropout.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

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


class _ResumableSampler(DistributedSampler):
    """DistributedSampler (shuffled by seed + epoch, tail dropped) that can begin an epoch part-way through this
    rank's share: a resumed run skips the samples it already trained on without reading them."""

    def __init__(self, dataset: Dataset, *, dp_rank: int, dp_size: int, seed: int):
        super().__init__(dataset, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=seed, drop_last=True)
        self.skip = 0

    def start_at(self, epoch: int, skip: int) -> None:
        self.set_epoch(epoch)
        self.skip = skip

    def __iter__(self):
        return itertools.islice(super().__iter__(), self.skip, None)

    def __len__(self) -> int:
        return self.num_samples - self.skip


class ERA5Batches:
    """One data-parallel rank's endless training stream: next_batch() -> (x, y) on `device`, [B, C, H, W].

    Epoch e deals the permutation of seed + e over the dp ranks as DistributedSampler does (drop_last: every
    rank takes `steps_per_epoch` full batches, no sample twice); when an epoch is used up the next begins.
    `epoch` and `step_in_epoch` say where the NEXT batch comes from. state_dict() / load_state_dict() resume
    exactly: the sampler starts that epoch's share step_in_epoch * batch_size samples in. The DataLoader gets
    a generator of its own, so drawing batches never advances torch's global RNG (dropout stays reproducible).
    On CUDA: pinned host memory and the next batch copied on a side stream while this one computes.
    close() stops the worker processes; the stream restarts them if used again.
    """

    def __init__(self, dataset: Dataset, *, batch_size: int, dp_rank: int = 0, dp_size: int = 1, seed: int = 0,
                 device: torch.device | str = CPU, num_workers: int = 0, pin_memory: bool | None = None,
                 persistent_workers: bool = True, prefetch_factor: int = 2):
        check_sharding(batch_size, dp_rank, dp_size, num_workers)
        self.batch_size, self.dp_rank, self.dp_size, self.seed = batch_size, dp_rank, dp_size, seed
        self.num_samples = len(dataset)
        self.steps_per_epoch = self.num_samples // dp_size // batch_size
        if self.steps_per_epoch == 0:
            raise DataError(f"{_describe(dataset)} has {self.num_samples} samples, too few for one training step: "
                            f"dp_size={dp_size} ranks x batch_size={batch_size} need at least "
                            f"{dp_size * batch_size}. Lower batch_size (or the data-parallel size), or use more "
                            "data (a larger limit or more years)")
        self.device = torch.device(device)
        self.sampler = _ResumableSampler(dataset, dp_rank=dp_rank, dp_size=dp_size, seed=seed)
        worker_options = {}
        if num_workers > 0:
            worker_options = {"persistent_workers": persistent_workers, "prefetch_factor": prefetch_factor}
        self.loader = DataLoader(dataset, batch_size=batch_size, sampler=self.sampler, num_workers=num_workers,
                                 pin_memory=self.device.type == "cuda" if pin_memory is None else pin_memory,
                                 drop_last=True, generator=torch.Generator().manual_seed(seed), **worker_options)
        self.epoch, self.step_in_epoch = 0, 0
        self._batches = None  # built on the next next_batch(), from the position above

    def _host_batches(self, epoch: int, step: int):
        while True:
            self.sampler.start_at(epoch, step * self.batch_size)
            yield from self.loader
            epoch, step = epoch + 1, 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._batches is None:
            self._batches = _on_device(self._host_batches(self.epoch, self.step_in_epoch), self.device)
        x, y = next(self._batches)
        self.step_in_epoch += 1
        if self.step_in_epoch == self.steps_per_epoch:
            self.epoch, self.step_in_epoch = self.epoch + 1, 0
        return x, y

    def state_dict(self) -> dict:
        """This rank's position, plain ints; save one per dp rank (the positions are equal, the shares not)."""
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "dp_rank": self.dp_rank,
                "dp_size": self.dp_size, "batch_size": self.batch_size, "seed": self.seed,
                "num_samples": self.num_samples}

    def load_state_dict(self, state: dict) -> None:
        for key in ("dp_rank", "dp_size", "batch_size", "seed", "num_samples"):
            if int(state[key]) != getattr(self, key):
                raise ValueError(f"this data state was saved with {key}={state[key]}, but this stream has "
                                 f"{key}={getattr(self, key)}: it cannot resume the same batches. Resume with the "
                                 "run's data settings and layout (each dp rank loads its own state)")
        if not 0 <= int(state["step_in_epoch"]) < self.steps_per_epoch or int(state["epoch"]) < 0:
            raise ValueError(f"data state epoch={state['epoch']}, step_in_epoch={state['step_in_epoch']} is not a "
                             f"position of a stream with {self.steps_per_epoch} steps per epoch")
        self.epoch, self.step_in_epoch = int(state["epoch"]), int(state["step_in_epoch"])
        self._batches = None  # drops a batch fetched ahead; the next next_batch() starts from the new position

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
                 device: torch.device | str = CPU, num_workers: int = 0, pin_memory: bool | None = None):
        check_sharding(batch_size, dp_rank, dp_size, num_workers)
        if len(dataset) == 0:
            raise DataError(f"{_describe(dataset)} has no samples to evaluate on: point the evaluation at a "
                            "split with data")
        self.device = torch.device(device)
        self.sampler = _PaddedDeal(len(dataset), batch_size=batch_size, dp_rank=dp_rank, dp_size=dp_size)
        self.loader = DataLoader(_Weighted(dataset), batch_size=batch_size, sampler=self.sampler,
                                 num_workers=num_workers, generator=torch.Generator(),
                                 pin_memory=self.device.type == "cuda" if pin_memory is None else pin_memory)

    def __len__(self) -> int:
        return self.sampler.num_batches

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        return _on_device(self.loader, self.device)


def eval_batches(dataset: Dataset, *, batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 device: torch.device | str = CPU, num_workers: int = 0,
                 pin_memory: bool | None = None) -> EvalBatches:
    """This dp rank's exact evaluation pass over `dataset`: see EvalBatches."""
    return EvalBatches(dataset, batch_size=batch_size, dp_rank=dp_rank, dp_size=dp_size, device=device,
                       num_workers=num_workers, pin_memory=pin_memory)
