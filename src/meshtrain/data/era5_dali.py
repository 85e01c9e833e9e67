"""NVIDIA DALI as the ViT's training loader (NERSC's `data_loader_config: dali`), an optional extra.

    pip install 'meshtrain[dali]'          # nvidia-dali-cuda120
    meshtrain train vit data.loader=dali num_data_workers=8

The batches are exactly ERA5Batches' (the same permutation per epoch, the same share per dp rank, the same
resume position), only the work moves: a DALI pipeline reads the samples through a parallel external source
(`num_workers` Python worker processes reading the h5 files, as NERSC's loader does), assembles the batches
and, on a GPU, copies them to the device itself, `prefetch_factor` batches ahead of the training step. On a
machine without a GPU the pipeline runs on the CPU (device_id=None), which is how the tests run it.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from meshtrain.data.era5_batches import ERA5Batches, GlobalBatchOrder
from meshtrain.data.text import DataError


def dali_available() -> bool:
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        return False
    return True


class _RankSamples:
    """DALI's per-sample source: this rank's samples in GlobalBatchOrder, from global batch `first_step` on; a DALI
    epoch is one of the order's epochs (the first entered part-way), StopIteration ends it. Picklable (DALI's worker
    processes each get a copy; the dataset opens its own files there)."""

    def __init__(self, dataset: Dataset, order: GlobalBatchOrder, first_step: int):
        self.dataset, self.order, self.first_step = dataset, order, first_step
        self.per_step = order.accum * order.batch_size  # this rank's samples per global batch
        self._ids: tuple[int, list[int]] | None = None

    def __call__(self, info) -> tuple[np.ndarray, np.ndarray]:
        epochs = self.order.steps_per_epoch
        start = self.first_step if info.epoch_idx == 0 else (self.first_step // epochs + info.epoch_idx) * epochs
        step, within = divmod(info.idx_in_epoch, self.per_step)
        step += start
        if step >= (start // epochs + 1) * epochs:
            raise StopIteration
        if self._ids is None or self._ids[0] != step:
            self._ids = (step, self.order.rank_ids(step))
        x, y = self.dataset[self._ids[1][within]]
        return x.numpy(), y.numpy()


class ERA5DaliBatches(ERA5Batches):
    """ERA5Batches (same API, same batches) with a DALI pipeline doing the reading, batching and device copy."""

    def __init__(self, dataset: Dataset, *, batch_size: int, dp_rank: int = 0, dp_size: int = 1, accum: int = 1,
                 seed: int = 0, device: torch.device | str = "cpu", num_workers: int = 0, prefetch_factor: int = 2,
                 **_loader_options):
        if not dali_available():
            raise DataError("data.loader=dali needs NVIDIA DALI: pip install 'meshtrain[dali]' (nvidia-dali-cuda120), "
                            "or use data.loader=pytorch")
        super().__init__(dataset, batch_size=batch_size, dp_rank=dp_rank, dp_size=dp_size, accum=accum, seed=seed,
                         device=device)
        self.dataset, self.num_workers, self.prefetch_factor = dataset, num_workers, prefetch_factor
        self._iterator = None

    def _dali_batches(self, step: int):
        from nvidia.dali import fn, pipeline_def
        from nvidia.dali.plugin.pytorch import DALIGenericIterator

        on_gpu = self.device.type == "cuda"
        source = _RankSamples(self.dataset, self.order, step)
        parallel = self.num_workers > 0

        @pipeline_def(batch_size=self.batch_size, num_threads=max(1, self.num_workers),
                      device_id=(self.device.index or 0) if on_gpu else None, prefetch_queue_depth=self.prefetch_factor,
                      py_num_workers=max(1, self.num_workers), py_start_method="spawn")
        def pipeline():
            x, y = fn.external_source(source=source, num_outputs=2, batch=False, parallel=parallel,
                                      dtype=[_dali_float(), _dali_float()])
            return (x.gpu(), y.gpu()) if on_gpu else (x, y)

        pipe = pipeline()
        pipe.build()
        self._iterator = DALIGenericIterator([pipe], ["x", "y"], auto_reset=True)
        while True:
            for batch in self._iterator:  # one epoch; auto_reset starts the next
                yield batch[0]["x"].to(self.device), batch[0]["y"].to(self.device)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._batches is None:
            self._batches = self._dali_batches(self.step)
        return super().next_batch()

    def close(self) -> None:
        """Stop the pipeline and its worker processes."""
        self._batches, self._iterator = None, None


def _dali_float():
    from nvidia.dali import types

    return types.FLOAT
