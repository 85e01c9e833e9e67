"""GPT-2 124M training steps on one GPU, outside the trainer: which lever moves MFU, and where a step's time goes.

    python benchmarks/gpt2_step_lab.py                                   # every variant, then a profile of the first
    python benchmarks/gpt2_step_lab.py --variants b12,b16-blocks --profile b16-blocks --json out.json

Each variant is meshtrain's own GPT (GPT-2 small: 12 × 768, block 1024, vocab 50304, biases) in bf16 autocast with
fused AdamW, the global batch 48 × 1024 tokens per iteration split into micro-batches. A variant names its
micro-batch (bNN), then its levers: `wNNNN` a wider decoder (12 layers, 128-wide heads), `fp8t` / `fp8r` the
blocks' linears in torchao's float8 (tensorwise / rowwise scales), `model` compiles the whole model, `blocks` each block apart (regional
compilation: one graph, compiled once, reused by all 12 blocks), `eager` none; `cudnn` / `flash` / `efficient` pin
the SDPA kernel; `chunked` computes the loss in vocabulary-sized chunks of tokens (the logits of the whole
micro-batch never exist at once). MFU counts 6N + 12·L·H·Q·T FLOPs per token (models.gpt.GPT.flops_per_token)
against the datasheet's dense bf16 peak; the step time is the median of timed iterations after warm-up, with CUDA
events, the loss never read back in between (no host synchronisation in the loop).

`--profile VARIANT` runs torch.profiler over one iteration of that variant and prints the kernels with the largest
shares of GPU time: the evidence for which lever to pull next.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from meshtrain.models.gpt.model import GPT, GPTConfig

GLOBAL_BATCH = 48  # sequences of 1024 tokens per iteration: nanoGPT's GPT-2 recipe per GPU is 12 × 40 accumulation
DEFAULT_VARIANTS = "b12-model,b16-model,b16-blocks,b24-blocks,b16-blocks-cudnn,b16-blocks-chunked,b48-blocks-chunked"


def chunked_loss(model: GPT, hidden: torch.Tensor, targets: torch.Tensor, chunks: int) -> torch.Tensor:
    """Mean cross-entropy of the logits of `hidden`, computed `chunks` token-slices at a time."""
    hidden, targets = hidden.reshape(-1, hidden.size(-1)), targets.reshape(-1)
    total = hidden.new_zeros((), dtype=torch.float32)
    for h, t in zip(hidden.chunk(chunks), targets.chunk(chunks), strict=True):
        total = total + F.cross_entropy(model.logits(h).float(), t, reduction="sum")
    return total / targets.numel()


def build(variant: str, device: torch.device):
    levers = variant.split("-")
    micro = int(levers[0][1:])
    width = next((int(lever[1:]) for lever in levers if lever[0] == "w" and lever[1:].isdigit()), 768)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=12, n_head=width // 64 if width == 768 else width // 128, n_embd=width,
                          block_size=1024, vocab_size=50304, bias=True)).to(device)
    if "fp8t" in levers or "fp8r" in levers:  # torchao's float8 linears in every block (not the tied head)
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        recipe = "tensorwise" if "fp8t" in levers else "rowwise"
        convert_to_float8_training(model.transformer.h, config=Float8LinearConfig.from_recipe_name(recipe))
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    chunked = "chunked" in levers

    def micro_step(x, y):
        if chunked:
            h = model.embed(x)
            for block in model.transformer.h.values():
                h = block(h)
            return chunked_loss(model, h, y, chunks=max(1, micro // 4))
        return model(x, y)[1]

    if "model" in levers:
        micro_step = torch.compile(micro_step)
    elif "blocks" in levers:
        for block in model.transformer.h.values():
            block.compile()
    return model, optimizer, micro_step, micro, levers


def sdpa_backends(levers: list[str]):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    named = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION}
    chosen = [named[lever] for lever in levers if lever in named]
    return sdpa_kernel(chosen) if chosen else contextlib.nullcontext()


def run(variant: str, steps: int, warmup: int, profile: bool) -> dict:
    device = torch.device("cuda")
    model, optimizer, micro_step, micro, levers = build(variant, device)
    accum = GLOBAL_BATCH // micro
    generator = torch.Generator(device=device).manual_seed(1)
    batches = [torch.randint(50257, (micro, 1025), device=device, generator=generator) for _ in range(4)]

    def iteration(i: int) -> torch.Tensor:
        loss_sum = torch.zeros((), device=device)
        for m in range(accum):
            tokens = batches[(i * accum + m) % len(batches)]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = micro_step(tokens[:, :-1], tokens[:, 1:]) / accum
            loss.backward()
            loss_sum += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss_sum

    torch.cuda.reset_peak_memory_stats()
    with sdpa_backends(levers):
        started = time.perf_counter()
        for i in range(warmup):
            iteration(i)
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - started
        times = []
        for i in range(steps):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            loss = iteration(warmup + i)
            end.record()
            times.append((begin, end))
        torch.cuda.synchronize()
        ms = statistics.median(b.elapsed_time(e) for b, e in times)
        top = profile_iteration(iteration) if profile else None
    tokens = micro * accum * 1024
    tps = tokens / (ms / 1e3)
    peak = 989.4e12 if "H100" in torch.cuda.get_device_name() or "H200" in torch.cuda.get_device_name() else None
    mfu = 100 * tps * model.flops_per_token() / peak if peak else None
    return {"variant": variant, "micro": micro, "accum": accum, "ms": ms, "tps": tps, "mfu": mfu,
            "mem_gib": torch.cuda.max_memory_allocated() / 2**30, "warmup_s": compile_s, "loss": float(loss),
            "top_kernels": top}


def profile_iteration(iteration) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        iteration(10_000)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if str(e.device_type).endswith("CUDA")]
    total = sum(e.self_device_time_total for e in events) or 1.0
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    return [{"kernel": e.key[:110], "share": e.self_device_time_total / total, "ms": e.self_device_time_total / 1e3,
             "calls": e.count} for e in events[:20]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=DEFAULT_VARIANTS)
    parser.add_argument("--profile", default="b12-model", help="the variant to profile ('' for none)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", help="write every result here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("GPT-2 124M steps at block 1024 are for a GPU")
    torch.backends.cuda.matmul.allow_tf32 = True
    results = []
    for variant in args.variants.split(","):
        try:
            results.append(run(variant, args.steps, args.warmup, profile=variant == args.profile))
        except Exception as failure:  # one variant's failure (out of memory, a kernel refused) must not lose the rest
            results.append({"variant": variant, "error": f"{type(failure).__name__}: {str(failure)[:300]}"})
        torch._dynamo.reset()
        torch.cuda.empty_cache()
        print(json.dumps({k: v for k, v in results[-1].items() if k != "top_kernels"}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(f"\nGPT-2 124M, {GLOBAL_BATCH} × 1024 tokens per iteration, bf16, fused AdamW, one "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| variant | micro × accum | ms/iter | tokens/s | MFU | max allocated | warm-up s |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['variant']} | failed: {r['error'][:120]} ||||||")
            continue
        mfu = f"{r['mfu']:.1f}%" if r["mfu"] else "—"
        print(f"| {r['variant']} | {r['micro']} × {r['accum']} | {r['ms']:.1f} | {r['tps']:,.0f} | {mfu} | "
              f"{r['mem_gib']:.2f} GiB | {r['warmup_s']:.0f} |")
    for r in results:
        if r.get("top_kernels"):
            print(f"\nprofile of one iteration of {r['variant']}: kernels by share of GPU time")
            for k in r["top_kernels"]:
                print(f"{100 * k['share']:5.1f}%  {k['ms']:8.2f} ms  {k['calls']:5d}×  {k['kernel']}")


if __name__ == "__main__":
    main()
