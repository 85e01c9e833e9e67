"""Which windows stream a language model's dataset gets: the format (train.bin or shards) and the order.

    data.order=random  windows at offsets drawn from (seed, split, global batch) alone (text.TokenBatches; over a
                       sharded corpus, shards.ShardBatches): today's rule, the default
    data.order=epoch   one pass over the split per epoch, its documents in an order shuffled per epoch (keyed by
                       seed, split and epoch), cut into windows of block_size + 1 tokens that follow each other, so
                       each token is read once an epoch (but for a tail shorter than one window)

Both are functions of the global batch number alone, so either resumes exactly and reads the same in every layout.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from meshtrain.data.shards import ShardBatches, is_sharded, load_manifest, manifest_meta
from meshtrain.data.text import DataError, TokenBatches, load_meta, meta_or_builtin, window_seed

ORDERS = ("random", "epoch")


def dataset_meta(data_dir: Path, *, builtin: bool = False) -> dict:
    """The meta of a prepared dataset, sharded (from its manifest) or single-file (meta.json); with `builtin`, a
    built-in dataset not prepared here gives what its tokenizer says (text.meta_or_builtin)."""
    if is_sharded(data_dir):
        return manifest_meta(load_manifest(data_dir))
    return meta_or_builtin(data_dir) if builtin else load_meta(data_dir)


def token_batches(data_dir: Path, split: str, order: str = "random", **kwargs) -> TokenBatches:
    """The windows stream of one split, whichever format the dataset is in."""
    if order == "epoch":
        if not is_sharded(data_dir):
            raise DataError(f"data.order=epoch shuffles documents, which {data_dir} (one train.bin) does not record: "
                            "prepare the corpus with `meshtrain prepare text PATH…`, or use data.order=random")
        return EpochBatches(data_dir, split, **kwargs)
    if order != "random":
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    return (ShardBatches if is_sharded(data_dir) else TokenBatches)(data_dir, split, **kwargs)


class EpochBatches(ShardBatches):
    """data.order=epoch over a sharded split. A sample's id is its number in the stream of all windows: window c of
    epoch e is sample e × windows_per_epoch + c, and global batch i holds samples i × G … (i + 1) × G - 1."""

    def _load(self) -> None:
        super()._load()
        self.doc_starts = self._tokens.document_starts()
        if len(self.doc_starts) == 0 or self.doc_starts[0] != 0:
            raise DataError(f"the {self.split} split of {self.data_dir} does not begin with a document: its index is "
                            "damaged; prepare the corpus again")
        self.doc_lengths = np.diff(np.append(self.doc_starts, self.num_tokens))
        self.windows_per_epoch = self.num_tokens // (self.block_size + 1)
        self._epoch: tuple[int, np.ndarray, np.ndarray] | None = None

    def global_offsets(self, step: int) -> torch.Tensor:
        """The sample ids of global batch `step` (the sample ledger's ids)."""
        return torch.arange(step * self.global_batch, (step + 1) * self.global_batch)

    def epoch_order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(the documents in epoch `epoch`'s order, where each begins in that epoch's stream)."""
        if self._epoch is None or self._epoch[0] != epoch:
            rng = np.random.Generator(np.random.PCG64(window_seed(self.seed, f"{self.split}:epoch", epoch)))
            order = rng.permutation(len(self.doc_starts))
            self._epoch = (epoch, order, np.concatenate([[0], np.cumsum(self.doc_lengths[order])]))
        return self._epoch[1], self._epoch[2]

    def _windows(self, ids: list[int]) -> np.ndarray:
        span = self.block_size + 1
        return np.stack([self._window(*divmod(int(k), self.windows_per_epoch), span) for k in ids])

    def _window(self, epoch: int, window: int, span: int) -> np.ndarray:
        """Tokens [window × span, (window + 1) × span) of the epoch's stream: pieces of the documents it crosses."""
        order, begins = self.epoch_order(epoch)
        position, pieces, left = window * span, [], span
        i = int(np.searchsorted(begins, position, side="right")) - 1
        while left:
            doc = order[i]
            within = position - int(begins[i])
            take = min(left, int(self.doc_lengths[doc]) - within)
            pieces.append(self._tokens.read(int(self.doc_starts[doc]) + within, take))
            position, left, i = position + take, left - take, i + 1
        return np.concatenate(pieces)
