"""`meshtrain plan` for machines we do not have, set beside what was published (benchmarks/data/published_figures.yaml,
read and checked by published_figures.py).

    python benchmarks/plan_published.py            # the comparisons, then the planning tables
    python benchmarks/plan_published.py --tables   # only the planning tables

Part 1 predicts each published run in its own layout on the nearest shipped system and prints predicted against
published, with the ratio. Part 2 plans GPT-2 124M / 350M / 1.5B, a 7B Llama-style decoder and NERSC's ViT base
and mp on Polaris and Perlmutter: the first rows of each ranking.

What the prediction cannot see is listed beside each row: NERSC's memory is nvidia-smi's whole-device reading
(CUDA context, NCCL and allocator reserve included), throughput figures of compiled or fp8 runs, data loaders.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from meshtrain import config as config_mod
from meshtrain.errors import MeshtrainError
from meshtrain.parallel.mesh import ParallelDims
from meshtrain.plan import machines, search, systems
from meshtrain.plan.cost import predict
from meshtrain.plan.workload import ModelFacts

sys.path.insert(0, str(Path(__file__).parent))
from published_figures import PUBLISHED  # noqa: E402

# Published runs on machines outside the table, and the shipped system that stands in for each.
STAND_INS = {
    "a100-80gb-selene": ("perlmutter-80", 8, "Selene's DGX A100 nodes: 8 A100-80GB, 8 HDR IB = 25 GB/s per GPU, "
                                             "as perlmutter-80 with 8 GPUs per node"),
    "h100-cluster": ("dgx-h100", 8, "as a DGX H100 cluster"),
    "h100-96gb-grand-teton": ("dgx-h100", 8, "H100 96GB (Grand Teton), as a DGX H100 with 96 GiB"),
    "a100-single": ("polaris", 1, "one A100 40GB"),
}
COMPARED = ["nersc-sc24-vit-mp-tp1-4gpu", "nersc-sc24-vit-mp-tp4-16gpu", "nersc-sc23-vit-mp-tp1-4gpu",
            "nersc-sc23-vit-mp-tp4-16gpu", "nersc-dl4sci25-vit-mp1536-tp1-4gpu", "nersc-dl4sci25-vit-mp1536-tp4-16gpu",
            "megatron-sc21-gpt-1.7b", "megatron-sc21-gpt-3.6b", "megatron-h100-gpt-1.7b", "nanogpt-gpt2-124m-1gpu-mfu",
            "torchtitan-llama3-8b-8gpu-fsdp", "torchtitan-llama3-8b-8gpu-fsdp4-cp2-seq65536"]
DTYPE = {"fp16": "fp16", "bf16": "bf16", "mixed16": "bf16", "bf16+float8": "bf16", "tf32": "fp32", "fp32": "fp32"}


def machine_for(entry: dict) -> tuple[machines.Machine, int, str]:
    name, per_node, note = STAND_INS.get(entry["system"], (entry["system"], None, ""))
    system = systems.get(name)
    if per_node:
        system = replace(system, devices_per_node=per_node)
    if entry["system"] == "h100-96gb-grand-teton":
        system = systems.custom(system, device_memory_gib=96)
    return machines.from_system(system), per_node or entry.get("gpus_per_node") or system.devices_per_node, note


def run_config(entry: dict):
    """The run config and data facts of a published run, in its own layout."""
    m, lay = entry["model"], entry["layout"]
    gpus = entry["gpus"]
    tp, pp, cp = lay.get("tp") or 1, lay.get("pp") or 1, lay.get("cp") or 1
    dp = gpus // (tp * pp * cp)
    micro = lay.get("micro_batch") or max(1, min(4, lay["global_batch"] // dp))
    accum = lay.get("grad_accum") or max(1, lay["global_batch"] // (dp * micro))
    ac = lay.get("activation_checkpointing") or "none"
    common = [f"train.dtype={DTYPE[lay['dtype']]}", f"train.backend={lay['backend']}", f"parallel.tp={tp}",
              f"parallel.pp={pp}", f"parallel.cp={cp}", f"train.grad_accum={accum}",
              f"train.activation_checkpointing={ac}",
              f"parallel.sequence_parallel={str(bool(lay.get('sequence_parallel'))).lower()}"]
    if m["kind"] == "vit":
        overrides = ["preset=base", f"model.embed_dim={m['embed_dim']}", f"model.depth={m['depth']}",
                     f"model.num_heads={m['num_heads']}", f"model.patch_size={m['patch_size']}",
                     f"data.crop=[{m['img_size'][0]},{m['img_size'][1]}]", "data.root=/nonexistent/era5",
                     f"data.global_batch_size={lay['global_batch']}"]
        facts = {"img_size": m["img_size"], "channels": m["channels"]}
        common = [c for c in common if not c.startswith("train.grad_accum")]
    elif m["kind"] == "llama":
        overrides = [f"model.n_layer={m['n_layer']}", f"model.n_head={m['n_head']}", f"model.n_kv_head={m['n_kv_head']}",
                     f"model.n_embd={m['n_embd']}", f"model.ffn_hidden={m['ffn_hidden']}",
                     f"model.block_size={m['block_size']}", f"model.batch_size={micro}", "model.dropout=0.0"]
        facts = {"meta": {"vocab_size": m["vocab_size"]}}
    else:
        overrides = [f"model.n_layer={m['n_layer']}", f"model.n_head={m['n_head']}", f"model.n_embd={m['n_embd']}",
                     f"model.block_size={m['block_size']}", f"model.batch_size={micro}", "model.dropout=0.0",
                     f"model.bias={str(m.get('bias', True)).lower()}"]
        facts = {"meta": {"vocab_size": m["vocab_size"]}}
    if pp > 1:
        common += ["parallel.pp_schedule=interleaved_1f1b", "parallel.virtual_stages=2"]
    return config_mod.load_config([*overrides, *common], m["kind"]), facts


def compare() -> None:
    print("| published run | stands in | figure | predicted | published | predicted / published |")
    print("|---|---|---|---|---|---|")
    for entry in (e for e in PUBLISHED if e["id"] in COMPARED):
        machine, per_node, note = machine_for(entry)
        cfg, data_facts = run_config(entry)
        try:
            dims = ParallelDims.from_config(cfg, entry["gpus"], per_node)
        except MeshtrainError:  # NERSC's DDP over tensor-parallel ranks: not a layout meshtrain trains; same arithmetic
            p = cfg.parallel
            dims = ParallelDims.resolve(entry["gpus"], tp=p.tp, pp=p.pp, cp=p.cp)
        facts = ModelFacts.of(cfg, data_facts)
        cost = predict(facts, cfg, dims, machine)
        peak_label = "bf16" if cfg.train.dtype in ("bf16", "fp16") else "fp32"
        predicted = {
            "samples_per_s": cost.samples_per_iteration / cost.step_s,
            "memory_gib_per_gpu": cost.peak_bytes / 2**30,
            "tflops_per_gpu": cost.flops_per_iteration / cost.step_s / dims.world_size / 1e12,
            "mfu": cost.flops_per_iteration / cost.step_s / dims.world_size / machine.peak[peak_label],
            "tokens_per_s_per_gpu": cost.tokens_per_iteration / cost.step_s / dims.world_size,
            "iter_time_s": cost.step_s,
        }
        for figure, value in entry["figures"].items():
            if figure in predicted and value:
                print(f"| {entry['id']} ({entry['gpus']} GPUs, {search.label(cfg, dims)}) | {note or machine.name} | "
                      f"{figure} | {predicted[figure]:,.3g} | {value:,.3g} | {predicted[figure] / value:.2f} |")


TABLES = {  # what to plan -> (model, overrides, data facts)
    "GPT-2 124M": ("gpt", ["preset=gpt2", "train.dtype=bf16", "train.grad_accum=1"], {"meta": {"vocab_size": 50304}}),
    "GPT-2 350M": ("gpt", ["preset=gpt2", "model.n_layer=24", "model.n_head=16", "model.n_embd=1024",
                           "train.dtype=bf16", "train.grad_accum=1"], {"meta": {"vocab_size": 50304}}),
    "GPT-2 1.5B": ("gpt", ["preset=gpt2", "model.n_layer=48", "model.n_head=25", "model.n_embd=1600",
                           "model.batch_size=8", "train.dtype=bf16", "train.grad_accum=1"],
                   {"meta": {"vocab_size": 50304}}),
    "Llama 7B": ("llama", ["model.n_layer=32", "model.n_head=32", "model.n_kv_head=32", "model.n_embd=4096",
                           "model.ffn_hidden=11008", "model.block_size=4096", "model.batch_size=4", "train.dtype=bf16"],
                 {"meta": {"vocab_size": 32000}}),
    "ViT base (NERSC)": ("vit", ["preset=base", "data.root=/nonexistent/era5", "train.dtype=bf16",
                                 "data.global_batch_size=64"], None),
    "ViT mp (NERSC)": ("vit", ["preset=mp", "data.root=/nonexistent/era5", "train.dtype=bf16"], None),
}


def tables(rows: int = 4) -> None:
    for what, (model, overrides, data_facts) in TABLES.items():
        cfg = config_mod.load_config(overrides, model)
        facts = ModelFacts.of(cfg, data_facts)
        for system_name, nodes in (("polaris", 1), ("polaris", 4), ("perlmutter", 4)):
            machine = machines.from_system(systems.get(system_name))
            ranked, _ = search.search(cfg, nodes, machine.devices_per_node, machine, facts)
            fitting = sum(c.fits for c in ranked)
            print(f"\n{what} ({facts.num_params / 1e6:,.0f}M parameters) on {nodes} {system_name} node(s): "
                  f"{len(ranked)} layouts, {fitting} fit")
            print("| layout | fits | peak GiB | step ms | samples/s | MFU | bound by |")
            print("|---|---|---|---|---|---|---|")
            label = "bf16" if cfg.train.dtype in ("bf16", "fp16") else "fp32"
            for c in ranked[:rows]:
                mfu = c.cost.flops_per_iteration / c.cost.step_s / c.dims.world_size / machine.peak[label]
                print(f"| {c.label} | {'yes' if c.fits else 'NO'} | {c.cost.peak_bytes / 2**30:.1f} | "
                      f"{c.cost.step_s * 1e3:,.1f} | {c.throughput:,.1f} | {mfu:.0%} | {c.cost.bottleneck} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tables", action="store_true", help="only the planning tables")
    args = parser.parse_args()
    if not args.tables:
        compare()
    tables()


if __name__ == "__main__":
    main()
