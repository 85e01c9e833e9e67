"""float8 training (train.float8=tensorwise|rowwise) through torchao's Float8Linear, an optional extra.

    check(recipe, device)                      before any model is built: a device that computes float8, torchao there
    convert_blocks(blocks, recipe, fsdp=...)   each block's eligible Linear -> Float8Linear (before compile and FSDP)
    after_optimizer_step(model)                FSDP's float8 all-gather: every weight's scale, in one reduction

Only the repeated blocks are converted: the embedding and the output head stay in the training dtype (the head's
logits feed the loss, where float8's 3 mantissa bits cost accuracy for little time), as torchtitan does. A Linear
whose widths are not multiples of 16 stays as it is (the float8 matmul needs them), and so does one its model marks
`keep_precision` (the MoE's routers). `tensorwise` scales each tensor
by one number and, under FSDP2, gathers weights in float8 (half of bf16's bytes); `rowwise` scales each row, more
accurate and slower. The arithmetic runs on float8 tensor cores, which NVIDIA GPUs have from compute capability 8.9
(Ada, Hopper, Blackwell).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from torch import nn

from meshtrain.errors import MeshtrainError

MIN_CAPABILITY = (8, 9)


class Float8Error(MeshtrainError, RuntimeError):
    """train.float8 asked for where float8 training cannot run; the message names the device or the missing part."""


def check(recipe: str, device: torch.device) -> None:
    """Refuse train.float8 on a device without float8 tensor cores, or without torchao, before the model is built."""
    if recipe == "off":
        return
    if device.type != "cuda":
        raise Float8Error(f"train.float8={recipe}: float8 matmuls need an NVIDIA GPU of compute capability "
                          f"{_version(MIN_CAPABILITY)} or newer (Ada, Hopper, Blackwell); this rank runs on {device}. "
                          "Set train.float8=off")
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise Float8Error(f"train.float8={recipe}: {torch.cuda.get_device_name(device)} ({device}) is of compute "
                          f"capability {_version(capability)}, without float8 tensor cores (they start at "
                          f"{_version(MIN_CAPABILITY)}: Ada, Hopper, Blackwell). Set train.float8=off")
    _torchao(recipe)


def _version(capability: tuple[int, int]) -> str:
    return ".".join(map(str, capability))


def _torchao(recipe: str):
    try:
        from torchao import float8
    except ImportError:
        raise Float8Error(f"train.float8={recipe} trains through torchao's float8 linears, which are not installed: "
                          "pip install 'meshtrain[float8]' (torchao), or set train.float8=off") from None
    return float8


KEEP_PRECISION = "keep_precision"  # a model's mark on a Linear that float8 must leave as it is


def eligible(module: nn.Module, name: str = "") -> bool:
    """A Linear the float8 matmul can take (both widths multiples of 16) and its model did not mark KEEP_PRECISION
    (a mixture of experts' router: float8 logits would collapse close scores into ties and move tokens)."""
    return (isinstance(module, nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0
            and not getattr(module, KEEP_PRECISION, False))


def convert_blocks(blocks: Iterable[nn.Module], recipe: str, *, fsdp: bool, emulate: bool = False) -> int:
    """Swap every eligible Linear of `blocks` for torchao's Float8Linear (in place); returns how many were swapped.
    `fsdp`: the blocks will be sharded by FSDP2, so the tensorwise recipe gathers their weights in float8.
    `emulate` computes the float8 matmuls in higher precision (torchao's own emulation; for tests on a CPU)."""
    if recipe == "off":
        return 0
    float8 = _torchao(recipe)
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    config = dataclasses.replace(config, emulate=emulate,
                                 enable_fsdp_float8_all_gather=fsdp and recipe == "tensorwise")
    swapped = 0
    for block in blocks:
        swapped += sum(eligible(m) for m in block.modules())
        float8.convert_to_float8_training(block, config=config, module_filter_fn=eligible)
    return swapped


def gathers_in_float8(model: nn.Module) -> bool:
    """Whether FSDP2 gathers some of `model`'s weights in float8 (their scales are then computed after each step)."""
    return any(getattr(getattr(m, "config", None), "enable_fsdp_float8_all_gather", False) for m in model.modules()
               if type(m).__name__ == "Float8Linear")


def after_optimizer_step(model: nn.Module) -> None:
    """The scales of the weights FSDP2 gathers in float8, for the next forward: one all-reduce of every weight's
    amax instead of one a weight (torchao's precompute_float8_dynamic_scale_for_fsdp)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)
