"""What the CUDA caching allocator holds beyond the tensors a step asks for: the planner's GPU prediction was 0.1–0.5
GiB under `max_memory_allocated` on GPT-2 124M (docs/gpu.md, round 5). Two candidates, each measured here:

- cuBLAS's workspace, which torch takes from the caching allocator (one per handle and stream): the bytes a
  first matmul of each dtype leaves allocated beyond its output;
- the allocator's rounding: its peak of allocated bytes (whole blocks, what max_memory_allocated reports) against
  its peak of requested bytes (what the tensors asked for), over a GPT-2 124M step of meshtrain's own model in bf16
  autocast, eager, batch 12 × 1024 in 4 micro-batches, the whole loss (as round 5's row), fused AdamW.

Then what is alive at that step's peak, from the allocator's own history (`torch.cuda.memory._record_memory_history`,
its events replayed to the moment the most bytes were allocated): each live block's bytes under the line of
meshtrain or of torch that asked for it, largest first.

    python benchmarks/cuda_memory_items.py            # on a GPU: three tables
"""

from __future__ import annotations

import argparse
import sys

import torch

GiB, MiB = 2**30, 2**20


def workspace_rows(device: torch.device) -> list[tuple[str, float]]:
    """(matmul, MiB left allocated beyond its output) for the first matmul of each kind in this process."""
    rows = []
    for name, dtype, fn in (("bf16 a @ b", torch.bfloat16, lambda a, b: a @ b),
                            ("fp32 a @ b", torch.float32, lambda a, b: a @ b),
                            ("bf16 linear with bias (cublasLt)", torch.bfloat16,
                             lambda a, b: torch.nn.functional.linear(a, b, torch.ones(1024, device=device,
                                                                                      dtype=torch.bfloat16)))):
        a, b = (torch.randn(1024, 1024, device=device, dtype=dtype) for _ in range(2))
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(device)
        out = fn(a, b)
        torch.cuda.synchronize()
        extra = torch.cuda.memory_allocated(device) - before - out.numel() * out.element_size()
        rows.append((name, extra / MiB))
    return rows


def alive_at_peak(snapshot: dict, top: int = 16) -> tuple[float, list[tuple[str, int, float]]]:
    """(the peak's GiB, [(where, blocks, MiB)]) from a memory snapshot's trace of allocator events: the blocks alive
    at the moment the most were, grouped by the first frame of meshtrain's code that made them (else the first)."""
    live: dict[int, tuple[int, str]] = {}
    held = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for event in snapshot["device_traces"][0]:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], _where(event.get("frames", [])))
            held += event["size"]
            if held > peak:
                peak, at_peak = held, dict(live)
        elif event["action"] == "free_requested" and event["addr"] in live:
            held -= live.pop(event["addr"])[0]
    groups: dict[str, list[int]] = {}
    for size, where in at_peak.values():
        groups.setdefault(where, []).append(size)
    rows = sorted(((w, len(sizes), sum(sizes) / MiB) for w, sizes in groups.items()), key=lambda r: -r[2])
    return peak / GiB, rows[:top]


def _where(frames: list[dict]) -> str:
    """file:line function of the first frame in meshtrain (else in torch's Python, else the first)."""
    for wanted in ("meshtrain", "torch", ""):
        for frame in frames:
            if wanted in frame["filename"] and frame["filename"].endswith(".py"):
                return f"{frame['filename'].split('/')[-1]}:{frame['line']} {frame['name']}"
    return "(no Python frame)"


def step_peaks(device: torch.device, steps: int = 3) -> tuple[dict[str, float], dict]:
    from meshtrain.models.gpt.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=1024, vocab_size=50257, n_layer=12, n_head=12, n_embd=768, dropout=0.0)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, fused=True)
    idx = torch.randint(0, 50257, (4, 12, 1024), device=device)
    for step in range(steps):
        if step == steps - 1:  # the last step alone: the optimizer state exists, as in a run's steady state
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
            torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
            before = torch.cuda.memory_allocated(device)  # the weights and AdamW's state: no events of their own
        for micro in idx:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(micro, micro.roll(-1, 1))[1]  # not the logits: held, they would sit in the next forward
            (loss / len(idx)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    stats = torch.cuda.memory_stats(device)
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    return {"allocated": stats["allocated_bytes.all.peak"] / GiB, "requested": stats["requested_bytes.all.peak"] / GiB,
            "reserved": stats["reserved_bytes.all.peak"] / GiB, "held before the step": before / GiB}, snapshot


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    if not torch.cuda.is_available():
        sys.exit("this benchmark measures the CUDA caching allocator: run it on a GPU")
    device = torch.device("cuda")
    print(f"one {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| first matmul of its kind (1024 × 1024) | MiB allocated beyond its output |\n|---|---|")
    for name, extra in workspace_rows(device):
        print(f"| {name} | {extra:.2f} |")
    peaks, snapshot = step_peaks(device)
    print("\n| GPT-2 124M step, bf16 eager, 12 × 1024 × 4, whole loss | GiB |\n|---|---|")
    for name, value in peaks.items():
        print(f"| {'' if name.startswith('held') else 'peak '}{name} | {value:.3f} |")
    print(f"| allocated − requested (the allocator's rounding) | {peaks['allocated'] - peaks['requested']:.3f} |")
    peak, rows = alive_at_peak(snapshot)
    print(f"\nAlive at the step's peak beside what was held before it ({peak:.3f} GiB, the recorded events replayed):")
    print("| made at | blocks | MiB |\n|---|---|---|")
    for where, blocks, mib in rows:
        print(f"| `{where}` | {blocks} | {mib:,.1f} |")


if __name__ == "__main__":
    main()
