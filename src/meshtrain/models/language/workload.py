"""A language model as a workload of the one training loop: token windows in, text samples out. The GPT and the
Llama-style decoder both run through it; a model's spec gives it the model and the layout builder.

What the trainer asks of a workload (see train/trainer.py): the model, its layout on the mesh, the batch stream, an
evaluation that returns reduced metrics, and what to show after it (here, a sample from the prompt).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from meshtrain.config import ConfigError
from meshtrain.data.streams import dataset_meta, token_batches
from meshtrain.data.tokenizers import tokenizer_from_meta
from meshtrain.models.language import with_loss_chunks
from meshtrain.nn.meta import on_meta
from meshtrain.parallel.mesh import ParallelDims
from meshtrain.runtime.progress import track
from meshtrain.runtime.setup import DistInfo, broadcast_object, collective, reduce_scalar

if TYPE_CHECKING:  # for annotations only
    from meshtrain.config import RunConfig


class _Batches:
    """The three windows streams of one rank: training, and separate ones for evaluation so that evaluating never
    shifts what training sees next. Each is keyed by the global batch number alone (data/text.py): training's is
    the iteration, an evaluation at iteration i reads eval_iters global batches from number i × eval_iters."""

    def __init__(self, data_dir: Path, cfg: RunConfig, dp_rank: int, dp_size: int, device: torch.device):
        common = dict(block_size=cfg.model.block_size, batch_size=cfg.model.batch_size, dp_rank=dp_rank,
                      dp_size=dp_size, accum=cfg.train.grad_accum, device=device)
        seed = cfg.train.seed
        # train.bin or a sharded corpus; data.order for training (evaluation draws random windows either way)
        self.train = token_batches(data_dir, "train", order=cfg.data.order, seed=seed, **common)
        self.eval = {"train": token_batches(data_dir, "train", seed=seed + 1, **common),
                     "val": token_batches(data_dir, "val", seed=seed + 2, **common)}

    def next_batch(self):
        return self.train.next_batch()

    def seek(self, iteration: int) -> None:
        self.train.seek(iteration)

    def global_ids(self, iteration: int) -> list[int]:
        """The samples of iteration `iteration`, all ranks': its windows' start offsets (in a sharded corpus, in the
        split's shards laid end to end; with data.order=epoch, the windows' numbers)."""
        return self.train.global_offsets(iteration).tolist()

    def close(self) -> None:
        """Nothing to stop: the token windows are read in this process."""


def text_data_facts(cfg: RunConfig) -> dict:
    """What a language model's build takes from its data (the vocabulary in meta.json), without opening the tokens;
    for a built-in dataset not prepared here, its tokenizer's (a plan for another machine needs no data)."""
    return {"meta": dataset_meta(Path(cfg.data.root) / cfg.data.name, builtin=True)}


class LanguageModelWorkload:
    def __init__(self, cfg: RunConfig, info: DistInfo, dims: ParallelDims, *, build_model: Callable, build_layout: Callable):
        """build_model(cfg, data_facts) -> the model; build_layout(model, cfg, dims, mesh, device, rank) -> its
        parallel.lm_layout.LanguageModelLayout."""
        self.info, self.dims, self.device = info, dims, info.torch_device
        self._build_model, self._build_layout = build_model, build_layout
        self.data_dir = Path(cfg.data.root) / cfg.data.name
        self.meta = dataset_meta(self.data_dir)  # training needs the prepared data itself
        self.cfg = cfg = with_loss_chunks(cfg, self.meta["vocab_size"], self.device.type)  # auto's, for this device
        self.tokenizer = tokenizer_from_meta(self.meta)
        try:  # the prompt is first used at the first evaluation: find a bad one now
            self.prompt_ids = self.tokenizer.encode(cfg.train.prompt)
        except ValueError as e:
            raise ConfigError(f"train.prompt={cfg.train.prompt!r} cannot be encoded for "
                                         f"{cfg.data.name}: {e}") from None
        self.batch_size = cfg.model.batch_size
        self.tokens_per_sample = cfg.model.block_size
        self.iters_per_epoch = None  # random windows: no epochs
        self.batches = _Batches(self.data_dir, cfg, dims.dp_rank(info.rank), dims.dp_size, self.device)
        self.generator = torch.Generator(device=self.device)

    def build_model(self):
        return self._build_model(self.cfg, self.data_facts())

    def build_layout(self, model, mesh):
        # A copy for sampling is built like the whole model (a pipeline stage keeps only its part), without dropout.
        self.sampler_factory = lambda: type(model)(replace(model.config, dropout=0.0))
        return self._build_layout(model, self.cfg, self.dims, mesh, self.device, self.info.rank)

    def data_facts(self) -> dict:
        """What the model's build takes from the data (the vocabulary), kept in checkpoints for export and sample,
        with the text of the tokenizer's files: sample reads them there, not where prepare found them."""
        files = self.tokenizer.files()
        return {"meta": {**self.meta, "tokenizer_files": files} if files else self.meta}

    def evaluate(self, layout, autocast, it: int) -> dict[str, float]:
        """Mean loss over eval_iters global batches of each split (the training's global batch: every rank reads
        its share, as in a training step), over the ranks that hold a loss."""
        t = self.cfg.train
        out = {}
        batches = t.eval_iters * t.grad_accum  # this rank's share of eval_iters global batches
        for split, split_batches in self.batches.eval.items():
            split_batches.seek(it * t.eval_iters)
            total = torch.zeros((), device=self.device)
            for _ in track(range(batches), f"eval {split}", is_main=self.info.is_main):
                total += layout.eval_loss(*split_batches.next_batch(), autocast)
            out[f"{split}_loss"] = reduce_scalar(total / batches, "sum", f"all_reduce of the {split} loss",
                                                 self.info.timeout_s) / layout.loss_ranks
        return out

    def after_eval(self, it: int, layout, autocast, sinks, result) -> None:
        """A sample from the prompt, generated on rank 0 from the whole model gathered from every layout."""
        t = self.cfg.train
        with collective("gathering the model for sampling", self.info.timeout_s):
            weights = layout.full_state_for_sampling()
        text = None
        if self.info.is_main:
            # A whole copy of the model for this sample only: kept, it would sit on rank 0's device beside every later
            # step (GPT-2 124M: 0.46 GiB; a 7B model: 28 GB on one rank of an FSDP job that shards the rest). Built
            # on the meta device: a real init would draw from the dropout RNG.
            with on_meta():
                sampler = self.sampler_factory().eval()
            sampler.to_empty(device=self.device)
            sampler.load_state_dict(weights)
            self.generator.manual_seed(t.seed + it)
            prompt = torch.tensor([self.prompt_ids], dtype=torch.long, device=self.device)
            with autocast:
                tokens = sampler.generate(prompt, t.sample_tokens, temperature=t.temperature, top_k=t.top_k,
                                          generator=self.generator)
            text = self.tokenizer.decode(tokens[0].tolist())
            del sampler, weights
        text = broadcast_object(text, "broadcast of the sample", self.info.timeout_s)
        result.samples.append(text)
        sinks.log_text(it, "sample", text)

    def describe(self) -> str:
        model = self.cfg.model
        return f"batch {model.batch_size} × block {model.block_size} tokens per data-parallel rank and micro-step"
