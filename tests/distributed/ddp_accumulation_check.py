"""Under torchrun: DDP with gradient accumulation must match one process on the whole global batch.

Every rank builds the same global batch and the same single-process reference; the DDP model sees
only this rank's share, in `accum` micro-steps of which only the last synchronises (the loop's
apply_data_parallel + gradient_sync). Gradients and parameters are compared after each of 3 steps.
"""

import sys

import torch

from meshtrain.dist import distributed
from meshtrain.models.gpt import GPT, GPTConfig
from meshtrain.parallel.data_parallel import apply_data_parallel, gradient_sync

ACCUM, MICRO, STEPS = 2, 3, 3

with distributed() as info:
    config = GPTConfig(block_size=16, vocab_size=65, n_layer=2, n_head=2, n_embd=32, dropout=0.0, bias=True)
    torch.manual_seed(0)
    reference = GPT(config)
    torch.manual_seed(0)
    model = GPT(config)
    ddp = apply_data_parallel(model, "ddp", info.torch_device, info.world_size)
    # SGD is linear in the gradients; Adam's first steps divide by |g| and would magnify rounding noise
    # in near-zero gradients into differences that say nothing about DDP.
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    worst_grad = worst_param = 0.0
    for step in range(STEPS):
        batch = torch.randint(0, 65, (info.world_size * ACCUM * MICRO, 17), generator=torch.Generator().manual_seed(step))
        x, y = batch[:, :-1], batch[:, 1:]
        _, loss = reference(x, y)
        loss.backward()
        mine = range(info.rank * ACCUM * MICRO, (info.rank + 1) * ACCUM * MICRO)
        for micro in range(ACCUM):
            rows = list(mine)[micro * MICRO:(micro + 1) * MICRO]
            with gradient_sync(ddp, micro == ACCUM - 1):
                _, micro_loss = ddp(x[rows], y[rows])
                (micro_loss / ACCUM).backward()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            worst_grad = max(worst_grad, ((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-12)).item())
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            worst_param = max(worst_param, (p - q).abs().max().item())
    ok = worst_grad < 1e-5 and worst_param < 1e-5
    print(f"rank {info.rank}: max relative gradient difference {worst_grad:.3g}, max parameter difference "
          f"{worst_param:.3g} after {STEPS} steps -> {'EQUAL' if ok else 'DIFFERENT'}", flush=True)
    exit_code = 0 if ok else 1
sys.exit(exit_code)
