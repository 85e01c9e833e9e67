"""Building a module on the meta device (shapes, no storage) without drawing its initial values.

A meta tensor holds no values, so its initialisers have nothing to do; but torch runs a meta tensor's normal_
through its Python references, whose first call imports torch._dynamo: a second of CPU in a process that plans
and compiles nothing (the planner builds the model on meta; a training rank imports it anyway, for DDP and
torch.optim).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode

# the initialisers whose meta kernels go through torch._refs (uniform_, zero_, fill_ and the rest do not)
_UNDRAWN = {torch.Tensor.normal_, torch.nn.init.normal_}


class _Undrawn(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _UNDRAWN:
            tensor = args[0] if args else kwargs["tensor"]  # nn.init passes it by name
            if tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


@contextmanager
def on_meta():
    """`with torch.device("meta")`, and normal_ on a meta tensor left undone."""
    with torch.device("meta"), _Undrawn():
        yield
