"""Your own loop with checkpoints that resume under another layout: a small decoder built from meshtrain's
transformer blocks (whose tensor- and context-parallel plans meshtrain knows), saved by one layout and continued
by another.

    torchrun --nproc-per-node 4 examples/resume_across_layouts.py --steps 10 --run-dir outputs/examples/resume
    torchrun --nproc-per-node 4 examples/resume_across_layouts.py --steps 20 --run-dir outputs/examples/resume \\
        --tp 2 --backend fsdp                        # resumes at step 10 under dp_shard 2 × tp 2
    mpirun -n 2 python examples/resume_across_layouts.py --steps 30 --run-dir outputs/examples/resume --cp 2
                                                     # and at step 20 with each sequence split over 2 ranks

The batch of a step comes from the step's own seed, so a resumed run sees what an unbroken one would have: the step
number is the whole data position. The last line is the loss and the sum of the parameters, to compare runs by.
"""

import argparse

import torch
from torch import nn

import meshtrain
from meshtrain.nn.transformer import Block


class TinyDecoder(nn.Module):
    def __init__(self, vocab: int = 32, width: int = 32, heads: int = 4, depth: int = 2, block: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Embedding(block, width)
        self.layers = nn.ModuleList(Block(width, heads, 4 * width, causal=True, dropout=0.0, bias=False)
                                    for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        # under context parallelism a rank holds some of the positions, not the first T
        positions = torch.arange(ids.shape[1], device=ids.device) if positions is None else positions
        x = self.embed(ids) + self.position(positions)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def counting(step: int, batch: int) -> torch.Tensor:
    """The global batch of `step`: sequences that count up from a random start by a random stride (1 to 3), mod 32:
    learnable from two tokens of context."""
    draw = torch.Generator().manual_seed(step)
    start, stride = torch.randint(32, (batch, 1), generator=draw), torch.randint(1, 4, (batch, 1), generator=draw)
    return (start + stride * torch.arange(17)) % 32


parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20, help="train up to this step (resuming from the latest)")
parser.add_argument("--tp", type=int, default=1)
parser.add_argument("--cp", type=int, default=1, help="context parallel: each sequence split over this many ranks")
parser.add_argument("--backend", default="fsdp", help="ddp | zero2 | fsdp | hsdp")
parser.add_argument("--batch", type=int, default=8, help="global batch: divided among the data-parallel ranks")
parser.add_argument("--run-dir", default="outputs/examples/resume")
parser.add_argument("--save-every", type=int, default=10)
args = parser.parse_args()

with meshtrain.distributed() as info:
    dims = meshtrain.ParallelDims(world_size=info.world_size, tp=args.tp, cp=args.cp)
    mesh = dims.build_mesh(info.torch_device.type) if info.world_size > 1 else None
    torch.manual_seed(0)
    model = meshtrain.parallelize(TinyDecoder().to(info.torch_device), dims, mesh, blocks="layers",
                                  backend=args.backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    checkpoints = meshtrain.Checkpoints(args.run_dir)
    start = checkpoints.load(model, optimizer)["step"] if checkpoints.latest() else 0
    per_replica, replica = args.batch // dims.dp_size, dims.dp_rank(info.rank)
    recorder = meshtrain.MetricsRecorder(args.run_dir, info, batch_size=per_replica, dp_size=dims.dp_size,
                                         tokens_per_sample=16)
    for step in range(start + 1, args.steps + 1):
        with recorder.section("dt"):
            ids = counting(step, args.batch)
            ids = ids[replica * per_replica:(replica + 1) * per_replica].to(info.torch_device)
            x, y, positions = ids[:, :-1], ids[:, 1:], None
            if dims.cp > 1:  # this rank's share of the tokens (ring attention's balanced causal order)
                x, y, positions = meshtrain.shard_sequence(x, y, dims.coords(info.rank)["cp"], dims.cp, "ring")
            logits = model(x, positions)
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        row = recorder.log(step, loss.detach())  # loss: the mean over the ranks
        if step % args.save_every == 0 or step == args.steps:
            checkpoints.save(step, model, optimizer)
    recorder.close()
    whole = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]  # gathers shards
    if info.is_main:
        print(f"final step={args.steps} loss={row['loss']:.6f} parameter_sum={sum(p.double().sum() for p in whole):.6f}")
