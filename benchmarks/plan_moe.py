"""`meshtrain plan` for a DeepSeek-V3-like mixture of experts (the moe model's preset deepseek_v3: 61 layers, width
7168, 256 routed experts of 2048 hidden, top-8, one shared expert, the first 3 layers dense; its attention is plain
attention of the same width, not MLA) on 64 DGX H100 nodes (512 GPUs): the ranking's first rows, then each chosen
layout's memory per rank term by term, its step time terms and the all-to-all bytes it sends.

    python benchmarks/plan_moe.py                       # 64 nodes, the default imbalance (1.25)
    python benchmarks/plan_moe.py --nodes 32 --imbalance 2

The vocabulary is DeepSeek-V3's (129,280), given as the data's facts: nothing is read from disk.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from meshtrain import config as config_mod
from meshtrain.plan import experts, machines, search, systems
from meshtrain.plan.workload import ModelFacts

VOCAB = 129_280  # DeepSeek-V3's tokenizer (its config.json, vocab_size)
GIB = 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--system", default="dgx-h100")
    parser.add_argument("--imbalance", type=float, default=None, help="ModelFacts.expert_imbalance (default 1.25)")
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args()
    cfg = config_mod.load_config(["preset=deepseek_v3"], "moe")
    facts = ModelFacts.of(cfg, {"meta": {"vocab_size": VOCAB}})
    if args.imbalance is not None:
        facts = replace(facts, expert_imbalance=args.imbalance)
    machine = machines.from_system(systems.get(args.system))
    started = time.perf_counter()
    ranked, refused = search.search(cfg, args.nodes, machine.devices_per_node, machine, facts)
    moe = facts.shape.moe
    print(f"{cfg.model.n_layer} layers ({len(moe.layers)} MoE), {facts.num_params / 1e9:.1f}B parameters, "
          f"{facts.model.num_active_params() / 1e9:.1f}B active (non-embedding); {facts.shape.experts} experts × "
          f"top-{moe.top_k}; batch {facts.configured_batch} × {facts.tokens} tokens per rank; "
          f"{args.nodes} × {machine.devices_per_node} {machine.name}; imbalance {facts.expert_imbalance}")
    print(f"{len(ranked)} valid layouts ({sum(refused.values())} refused) in {time.perf_counter() - started:.1f} s; "
          f"{sum(c.fits for c in ranked)} fit in {machine.device_memory_bytes / GIB:.0f} GiB × {search.HEADROOM}\n")
    print(f"{'#':>3}  {'layout':<30} {'fits':>4} {'peak GiB':>9} {'step s':>7} {'tokens/s':>10} {'MFU':>6}")
    for i, c in enumerate(ranked[:args.top], 1):
        print(f"{i:>3}  {c.label:<30} {'yes' if c.fits else 'NO':>4} {c.cost.peak_bytes / GIB:>9.2f} "
              f"{c.cost.step_s:>7.2f} {c.cost.tokens_per_iteration / c.cost.step_s:>10,.0f} {mfu(c, machine):>6.1%}")
    shown = [ranked[0], *(pick(ranked, label) for label in
                          ("fsdp dp512 ep8 ac=full", "fsdp dp512 ep64 ac=full", "fsdp dp512 ac=full"))]
    for c in {c.label: c for c in shown if c is not None}.values():
        terms(c, facts)


def pick(ranked: list, label: str):
    return next((c for c in ranked if c.label == label), None)


def mfu(c, machine) -> float:
    return c.cost.flops_per_iteration / c.cost.step_s / (machine.peak["bf16"] * c.dims.world_size)


def terms(c, facts: ModelFacts) -> None:
    """One layout's memory per rank, term by term, and what its time and all-to-alls are made of."""
    dims, tokens = c.dims, facts.configured_batch * facts.tokens
    link = "inside a node" if dims.ep <= 8 else f"across {dims.ep // 8} nodes"
    held = f"edp {dims.size('edp')}" if dims.ep > 1 else "sharded with their blocks"
    print(f"\n{c.label}: ep group of {dims.ep} ({link}), experts per rank "
          f"{facts.shape.experts // dims.ep}, {held}, routed rows a layer "
          f"{experts.routed_rows(facts, dims, tokens):,.0f} (balanced {tokens * facts.shape.moe.top_k:,})")
    for key, value in c.cost.memory.items():
        print(f"    memory {key:<24} {value / GIB:>9.3f} GiB")
    for key, value in c.cost.time.items():
        print(f"    time   {key:<24} {value * 1e3:>9.1f} ms")
    for key, value in c.cost.comm_bytes.items():
        print(f"    sent per iteration {key:<12} {value / GIB:>9.3f} GiB")


if __name__ == "__main__":
    main()
