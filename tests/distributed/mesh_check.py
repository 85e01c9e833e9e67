"""Run under torchrun: build each layout's DeviceMesh and check its groups against ParallelDims' arithmetic.

    python -m torch.distributed.run --standalone --nproc-per-node=4 tests/distributed/mesh_check.py \
        tp=2,dp_shard=2 dp_replicate=2,dp_shard=2

Each argument is one layout (comma-separated ParallelDims fields; the world size comes from the job).
Every rank records per layout (meshtrain.runtime.results.record) equal=True when the groups match, else the problems.
"""

import gc
import sys

import torch
import torch.distributed as dist

from meshtrain.parallel.mesh import DIMS, FLATTENED, ParallelDims, submesh
from meshtrain.runtime.results import record
from meshtrain.runtime.setup import collective, distributed


def parse(arg: str) -> dict:
    fields = dict(kv.split("=") for kv in arg.split(",") if kv)
    return {k: v if k == "order" else int(v) for k, v in fields.items()}


def check(info, arg: str) -> list[str]:
    dims = ParallelDims(world_size=info.world_size, **parse(arg))
    mesh = dims.build_mesh("cpu")
    problems = []
    if mesh.mesh_dim_names != dims.mesh_dims:
        problems.append(f"mesh dims {mesh.mesh_dim_names} != {dims.mesh_dims}")
    for name in (*DIMS, *FLATTENED):
        sub = submesh(mesh, name)
        want = dims.group_of(info.rank, name)
        if sub is None:
            if len(want) != 1:
                problems.append(f"{name}: no sub-mesh but group_of gives {want}")
            continue
        got = dist.get_process_group_ranks(sub.get_group())
        if got != want:
            problems.append(f"{name}: process group {got} != group_of {want}")
        if sub.get_local_rank() != want.index(info.rank):
            problems.append(f"{name}: local rank {sub.get_local_rank()} != {want.index(info.rank)}")
    dp = submesh(mesh, "dp")
    if dp is not None:  # one collective over the flattened dp group: the sum of the dp ranks
        t = torch.tensor([float(dims.dp_rank(info.rank))])
        with collective(f"all_reduce over the dp sub-mesh of {arg}"):
            dist.all_reduce(t, group=dp.get_group())
        if t.item() != sum(range(dims.dp_size)):
            problems.append(f"dp all_reduce gave {t.item()}, not {sum(range(dims.dp_size))}")
    return problems


def main():
    with distributed() as info:
        for arg in sys.argv[1:]:
            problems = check(info, arg)
            record(arg, equal=not problems, problems=problems)


if __name__ == "__main__":
    main()
    gc.freeze()  # leave without the interpreter's last collections: 0.5 s a rank
