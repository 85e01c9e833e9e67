"""A Hugging Face transformers GPT-2 (small, built from its config: no download) trained with FSDP × tensor
parallel through meshtrain.parallelize, on the Shakespeare text meshtrain ships.

    torchrun --nproc-per-node 4 examples/hf_gpt2_fsdp_tp.py --tp 2      # dp_shard 2 × tp 2
    mpirun -n 4 python examples/hf_gpt2_fsdp_tp.py --tp 2
    python examples/hf_gpt2_fsdp_tp.py                                  # one process: the same losses

needs `pip install transformers` (meshtrain[hf]).

GPT-2 needs two changes before a tensor-parallel plan fits it, both in `prepare_for_tensor_parallel` below:
its projections are transformers' Conv1D (a Linear with its weight transposed), and torch's Colwise/Rowwise styles
shard nn.Linear; and its attention computes q, k and v in one fused matrix, so a plain column split would give a
rank all of q and part of k. Its rows are reordered so that each rank's slice holds its own heads' q, k and v,
and each rank's attention splits its slice in three.
"""

import argparse
import gzip
from importlib.resources import files

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.pytorch_utils import Conv1D

import meshtrain

PLAN = {  # torch's styles, by module path from the model's root
    "transformer.h.*.attn.c_attn": ColwiseParallel(),  # each rank: its heads' q, k, v
    "transformer.h.*.attn.c_proj": RowwiseParallel(),  # partial sums over heads, all-reduced
    "transformer.h.*.mlp.c_fc": ColwiseParallel(),
    "transformer.h.*.mlp.c_proj": RowwiseParallel(),
}


def prepare_for_tensor_parallel(model: GPT2LMHeadModel, tp: int) -> None:
    for block in model.transformer.h:
        for parent in (block.attn, block.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, Conv1D):
                    linear = nn.Linear(child.weight.shape[0], child.weight.shape[1])
                    linear.weight.data.copy_(child.weight.t())
                    linear.bias.data.copy_(child.bias)
                    setattr(parent, name, linear)
        width = block.attn.embed_dim
        # rows [q | k | v] -> [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]: rank r's colwise slice is its heads' q, k and v
        order = torch.arange(3 * width).view(3, tp, width // tp).transpose(0, 1).reshape(-1)
        c_attn = block.attn.c_attn
        c_attn.weight.data, c_attn.bias.data = c_attn.weight.data[order], c_attn.bias.data[order]
        block.attn.split_size = width // tp


def batches(text: torch.Tensor, step: int, batch: int, block: int) -> torch.Tensor:
    """The global batch of `step`: the same on every rank, whatever the layout."""
    starts = torch.randint(len(text) - block, (batch,), generator=torch.Generator().manual_seed(step))
    return torch.stack([text[s:s + block] for s in starts])


parser = argparse.ArgumentParser()
parser.add_argument("--tp", type=int, default=1)
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--batch", type=int, default=8, help="global batch: divided among the data-parallel ranks")
parser.add_argument("--run-dir", default="outputs/examples/hf_gpt2")
args = parser.parse_args()

raw = gzip.decompress(files("meshtrain.data").joinpath("assets/tinyshakespeare.txt.gz").read_bytes()).decode()
vocab = sorted(set(raw))
text = torch.tensor([vocab.index(c) for c in raw[:200_000]])

with meshtrain.distributed() as info:
    dims = meshtrain.ParallelDims(world_size=info.world_size, tp=args.tp)
    mesh = dims.build_mesh(info.torch_device.type) if info.world_size > 1 else None
    torch.manual_seed(0)  # the same weights on every rank
    config = GPT2Config(vocab_size=len(vocab), n_positions=64, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config).to(info.torch_device)
    prepare_for_tensor_parallel(model, dims.tp)
    model = meshtrain.parallelize(model, dims, mesh, blocks="transformer.h", tp_plan=PLAN, backend="fsdp")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    per_replica = args.batch // dims.dp_size
    recorder = meshtrain.MetricsRecorder(args.run_dir, info, batch_size=per_replica, dp_size=dims.dp_size,
                                         tokens_per_sample=64, loss_ranks=info.world_size)
    replica = dims.dp_rank(info.rank)  # the tp ranks of one replica read the same samples
    for step in range(1, args.steps + 1):
        with recorder.section("dt"):
            ids = batches(text, step, args.batch, 64)[replica * per_replica:(replica + 1) * per_replica]
            with recorder.section("dtf"):
                loss = model(input_ids=ids.to(info.torch_device), labels=ids.to(info.torch_device)).loss
            with recorder.section("dtb"):
                loss.backward()
            with recorder.section("opt"):
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
        recorder.log(step, loss.detach(), grad_norm=norm)
    recorder.close()
