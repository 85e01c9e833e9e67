"""train.loss_chunks on this machine: the peak bytes of tensors of one GPT-2 124M training step with the whole
[tokens, vocabulary] logits and with the loss in chunks of tokens, and the tokens/s of a smaller GPT, side by side in
one run.

    python benchmarks/chunked_loss.py                      # GPT-2 124M, block 1024, batch 8; then the small GPT
    python benchmarks/chunked_loss.py --batch 2 --json out.json

Peak: meshtrain's own GPT (12 × 768, vocab 50,304, block 1024) takes one fp32 step (forward, backward, AdamW) on
the CPU under the planner's exact measure (plan/measured/measure.TensorBytes: every storage the step's ops make,
counted until it dies; the model and optimizer are made under it too), its peak taken from the step's start. The
meta device is not an option: TensorBytes counts real storages only; where a step of batch 8 is too slow, measure a
smaller one (--batch 1) beside the planner's peak of batch 8 (--predict, plan/cost.predict_peak). Speed: a 4 × 256 GPT with the same vocabulary
(block 256, batch 8), the median of timed fp32 steps after a warm-up, each variant in turn. The variants:
train.loss_chunks=off (the whole logits), auto (its chunk for this vocabulary) and one more chunk size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from meshtrain import config as config_mod
from meshtrain.models.gpt.model import GPT, GPTConfig
from meshtrain.models.language import resolve_loss_chunks
from meshtrain.parallel.mesh import ParallelDims
from meshtrain.plan.cost import predict_peak
from meshtrain.plan.machines import Machine
from meshtrain.plan.measured.measure import TensorBytes
from meshtrain.plan.workload import ModelFacts

GPT2 = dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50304)  # GPT-2 124M
SMALL = dict(n_layer=4, n_head=4, n_embd=256, vocab_size=50304)
MIB = 2**20


def variants(extra: int) -> dict[str, tuple[str, int | None]]:
    """Name -> (train.loss_chunks, tokens a chunk; None: the whole logits)."""
    auto = resolve_loss_chunks("auto", GPT2["vocab_size"])
    return {"off": ("off", None), f"auto ({auto})": ("auto", auto), str(extra): (str(extra), extra)}


def predicted_mib(rows: int, block: int, setting: str) -> float:
    """The planner's peak for GPT-2 124M on one CPU process (fp32, AdamW); its vocabulary, GPT-2's tokenizer's
    50,257 words, from data=shakespeare's meta."""
    cfg = config_mod.load_config(["data=shakespeare", "data.root=/nonexistent", "train.dtype=fp32",
                                  "model.n_layer=12", "model.n_head=12", "model.n_embd=768", f"model.block_size={block}",
                                  f"model.batch_size={rows}", f"train.loss_chunks={setting}"], "gpt")
    machine = Machine("this", 1, 0.0, {}, 0.0, 0.0, 0.0, 0.0, 0.0, overlap=False, cpu=True)
    return predict_peak(ModelFacts.of(cfg), cfg, ParallelDims.resolve(1), machine) / MIB


def batch(shape: dict, rows: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, shape["vocab_size"], (rows, block + 1), generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1], tokens[:, 1:]


def step(model: GPT, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    _, loss = model(x, y)  # the logits (None when chunked) not kept: as the trainer's micro-step
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def build(shape: dict, block: int, chunks: int | None) -> tuple[GPT, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**shape, block_size=block, loss_chunks=chunks))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)


def peak_mib(rows: int, block: int, chunks: int | None) -> tuple[float, float, float]:
    """(peak MiB of one step, MiB held before it, its loss)."""
    x, y = batch(GPT2, rows, block)
    with TensorBytes() as counted:
        model, optimizer = build(GPT2, block, chunks)
        held = counted.alive
        counted.mark()
        loss = step(model, optimizer, x, y)
    return counted.peak() / MIB, held / MIB, loss


def tokens_per_s(rows: int, block: int, chunks: int | None, steps: int) -> tuple[float, float]:
    """(median tokens/s over `steps` timed steps after one warm-up, the first step's loss)."""
    model, optimizer = build(SMALL, block, chunks)
    x, y = batch(SMALL, rows, block)
    first = step(model, optimizer, x, y)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step(model, optimizer, x, y)
        times.append(time.perf_counter() - started)
    return rows * block / statistics.median(times), first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8, help="GPT-2's sequences a measured step (block 1024)")
    parser.add_argument("--predict", type=int, default=8, help="GPT-2's sequences a step, as the planner predicts")
    parser.add_argument("--block", type=int, default=1024)
    parser.add_argument("--extra", type=int, default=2048, help="one more chunk size, tokens")
    parser.add_argument("--speed-batch", type=int, default=8, help="the small GPT's sequences a step (block 256)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps of the small GPT a variant")
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32 on the CPU")
    print(f"{'loss_chunks':>12} | GPT-2 124M b{args.batch}×{args.block}: peak MiB (held before) | loss      | "
          f"planned b{args.predict}: MiB | 4×256 GPT b{args.speed_batch}×256: tokens/s | loss")
    rows = []
    for name, (setting, chunks) in variants(args.extra).items():
        peak, held, loss = peak_mib(args.batch, args.block, chunks)
        planned = predicted_mib(args.predict, args.block, setting)
        speed, small_loss = tokens_per_s(args.speed_batch, 256, chunks, args.steps)
        rows.append(dict(loss_chunks=name, tokens=chunks, peak_mib=round(peak, 1), held_mib=round(held, 1),
                         loss=loss, planned_mib=round(planned, 1), tokens_per_s=round(speed, 1), small_loss=small_loss))
        print(f"{name:>12} | {peak:>26,.1f} ({held:,.1f}) | {loss:.6f} | {planned:>15,.1f} | {speed:>27,.0f} | "
              f"{small_loss:.6f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
