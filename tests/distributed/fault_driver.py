"""Run `meshtrain test-dist` through the real CLI with one rank made faulty.

    python fault_driver.py exit|sleep|diverge FAULTY_RANK [test-dist args...]

exit:    the faulty rank dies (os._exit(0), as if killed) in its 3rd optimizer step
sleep:   the faulty rank stops calling collectives (sleeps) in its 3rd optimizer step
diverge: the faulty rank nudges one parameter before the final check (gradients out of sync)
"""

import os
import sys
import time

import torch
import torch.distributed as dist

from meshtrain import commands
from meshtrain.runtime import check

mode, faulty_rank, rest = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
steps = 0
original_step = torch.optim.SGD.step
original_mismatch = check.parameter_mismatch


def faulty_step(self, *args, **kwargs):
    global steps
    steps += 1
    if steps == 3 and dist.get_rank() == faulty_rank:
        if mode == "exit":
            os._exit(0)
        if mode == "sleep":
            time.sleep(600)
    return original_step(self, *args, **kwargs)


def diverged_mismatch(model, timeout=None):
    if dist.get_rank() == faulty_rank:
        with torch.no_grad():
            next(model.parameters()).view(-1)[0] += 1e-6
    return original_mismatch(model, timeout)


torch.optim.SGD.step = faulty_step
check.parameter_mismatch = diverged_mismatch if mode == "diverge" else original_mismatch
sys.exit(commands.main(["test-dist", *rest]))
