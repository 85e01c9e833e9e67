"""Your own model and loop under DDP, with meshtrain's set-up and metrics only.

    torchrun --nproc-per-node 2 examples/ddp_loop.py --run-dir outputs/examples/ddp_loop
    mpirun -n 2 python examples/ddp_loop.py --run-dir outputs/examples/ddp_loop
    meshtrain report outputs/examples/ddp_loop          # the page of the run

The model learns a fixed linear map from noisy samples. Every rank draws the whole global batch from the same seed
and keeps its slice, so the run is the same on any number of ranks (DDP averages the ranks' gradients).
"""

import argparse

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import meshtrain

parser = argparse.ArgumentParser()
parser.add_argument("--run-dir", default="outputs/examples/ddp_loop")
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--batch", type=int, default=64, help="global batch: divided among the ranks")
args = parser.parse_args()

with meshtrain.distributed() as info:
    torch.manual_seed(0)
    truth = torch.randn(16, 4)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4)).to(info.torch_device)
    ddp = DistributedDataParallel(model) if info.world_size > 1 else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    per_rank = args.batch // info.world_size
    recorder = meshtrain.MetricsRecorder(args.run_dir, info, batch_size=per_rank, local_forward=True)
    for step in range(1, args.steps + 1):
        with recorder.section("dt"):
            with recorder.section("data"):
                x = torch.randn(args.batch, 16, generator=torch.Generator().manual_seed(step))
                y = x @ truth + 0.01 * torch.randn(args.batch, 4, generator=torch.Generator().manual_seed(-step))
                mine = slice(info.rank * per_rank, (info.rank + 1) * per_rank)
                x, y = x[mine].to(info.torch_device), y[mine].to(info.torch_device)
            with recorder.section("dtf"):
                loss = nn.functional.mse_loss(ddp(x), y)
            with recorder.section("dtb"):
                loss.backward()
            with recorder.section("opt"):
                optimizer.step()
                optimizer.zero_grad()
        if step % 20 == 0:
            recorder.log(step, loss.detach(), lr=optimizer.param_groups[0]["lr"])
    recorder.close()
