"""`train.backend=deepspeed`: DeepSpeed's ZeRO (stage 1, 2 or 3 from `parallel.zero_stage`) as one more
data-parallel backend, for users whose recipes and checkpoints already live in DeepSpeed.

DeepSpeed wants to own the step: its engine runs forward, scales the loss by the accumulation, does
the backward with its own gradient partitioning, and steps (and clips, from its config) only at the
accumulation boundary. So this backend hands the engine the model and meshtrain's optimizer and the
layout routes the loop's calls to it. It joins the process group meshtrain already made (gloo on CPU,
where `DS_ACCELERATOR=cpu` is set for it; NCCL on GPUs). Checkpoints are DeepSpeed's own (each rank's
partitions), written inside meshtrain's step directory and published like every other checkpoint;
`meshtrain export` consolidates them with DeepSpeed's zero_to_fp32. They resume under deepspeed only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from meshtrain.errors import MeshtrainError
from meshtrain.parallel.lm_layout import LanguageModelLayout

TAG = "deepspeed"  # the sub-directory of a step directory that holds DeepSpeed's files


class DeepSpeedUnavailable(MeshtrainError, ImportError):
    """train.backend=deepspeed without DeepSpeed installed."""


def _import(device: torch.device):
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before the import: DeepSpeed picks its accelerator then
    try:
        import deepspeed
    except ImportError as e:
        raise DeepSpeedUnavailable("train.backend=deepspeed needs DeepSpeed: pip install 'meshtrain[deepspeed]' "
                                   f"({e})") from None
    if device.type == "cpu":
        # DeepSpeed's CPU backend compiles a shared-memory all-reduce as it starts (25-30 s of C++ here, again
        # whenever the environment's paths change, as in a fresh checkout) that only its inference all-reduce
        # calls; training reduces through torch.distributed. Marked unusable, it is not built.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


def config(*, stage: int, micro_batch_size: int, grad_accum: int, grad_clip: float, dtype: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": grad_clip,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": dtype == "bf16"},
        "fp16": {"enabled": dtype == "fp16"},
        "zero_allow_untested_optimizer": True,  # meshtrain's AdamW (or the tests' SGD) is a plain torch optimizer
        "steps_per_print": 2**31 - 1,  # meshtrain logs; DeepSpeed stays quiet
        "wall_clock_breakdown": False,
    }


def initialize(model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, **settings):
    """(engine, the engine's optimizer): call the engine for forward, then engine.backward and engine.step."""
    deepspeed = _import(device)
    engine, ds_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config(**settings))
    return engine, ds_optimizer


def save_partitions(engine, directory: Path) -> None:
    """Every rank writes its partitions to directory/deepspeed/."""
    engine.save_checkpoint(str(directory), tag=TAG, save_latest=False)


def load_partitions(engine, directory: Path) -> None:
    if not (Path(directory) / TAG).is_dir():
        raise MeshtrainError(f"{directory} is not a DeepSpeed checkpoint: a run saved under another backend resumes "
                             "under a meshtrain backend (ddp, fsdp, ...), not train.backend=deepspeed")
    path, _ = engine.load_checkpoint(str(directory), tag=TAG)
    if path is None:
        raise MeshtrainError(f"DeepSpeed could not load {directory}/{TAG}")


def consolidated_state(directory: Path) -> dict[str, torch.Tensor]:
    """The whole fp32 model from a step directory's DeepSpeed partitions, on one process."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(directory), tag=TAG)


@dataclass
class EngineLayout(LanguageModelLayout):
    """A language model's layout whose forward, backward and optimizer step DeepSpeed's engine runs (data
    parallelism only: config refuses tp, cp and pp with it)."""

    settings: dict = field(default_factory=dict)  # config()'s keywords and the device, until attach_optimizer
    engine: object | None = None

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        self.engine, optimizer = initialize(self.model, optimizer, **self.settings)
        self.runnable = self.engine
        return optimizer

    def train_micro_step(self, x, y, *, accum: int, sync: bool, autocast, scaler, timer) -> torch.Tensor:
        with timer("dtf"), autocast:
            loss = self.engine(x, y)[1]  # the logits not kept through backward
        with timer("dtb"):
            self.engine.backward(loss)  # scales by 1 / accumulation itself
            self.engine.step()  # a real step only at the accumulation boundary
        return loss.detach().float() / accum

    def optimizer_step(self, optimizer, scaler, max_norm: float) -> torch.Tensor | None:
        """The engine stepped (and clipped, from its config) at the accumulation boundary: its norm."""
        return torch.tensor(float(self.engine.get_global_grad_norm() or 0.0)) if max_norm > 0 else None

    def save_checkpoint(self, checkpointer, iteration: int, optimizer, trainer_state: dict):
        return checkpointer.save_with(iteration, lambda path: save_partitions(self.engine, path), trainer_state)

    def load_checkpoint(self, checkpoint_dir, optimizer, load) -> None:
        """Its own partitions only: a checkpoint of another backend resumes under a meshtrain backend."""
        return load_partitions(self.engine, checkpoint_dir)

    def full_state_for_sampling(self) -> dict[str, torch.Tensor] | None:
        if self.dims.world_size == 1 or self.settings["stage"] != 3:
            return super().full_state_for_sampling()
        state = self.engine._zero3_consolidated_16bit_state_dict()  # partitioned: DeepSpeed gathers to rank 0
        if self.rank != 0:
            return None
        state = {k: v.detach().cpu() for k, v in state.items()}
        if self.split.tied:  # a tied weight is listed once
            copy, source = self.split.tied
            state.setdefault(copy, state[source])
        return state
