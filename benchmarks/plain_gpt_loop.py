"""A plain nanoGPT-style training loop, the side-by-side baseline for gpt_cpu_recipe.py.

No framework: fp32, one process, random windows from a memmap, AdamW (unfused, as nanoGPT on CPU),
warm-up + cosine, clipping, loss.item() every iteration. The model is the same architecture as
nanoGPT's (meshtrain's GPT file holds no framework code). Prints one JSON line of results.

    python benchmarks/plain_gpt_loop.py DATA_DIR [--iters 2000]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import numpy as np
import torch

from meshtrain.models.gpt.model import GPT, GPTConfig


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("data_dir")
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--eval-iters", type=int, default=20)
    args = parser.parse_args()
    started = time.time()
    torch.manual_seed(1337)
    block, batch = 64, 12
    data = {s: np.memmap(f"{args.data_dir}/{s}.bin", dtype=np.uint16, mode="r") for s in ("train", "val")}

    def get_batch(split: str):
        d = data[split]
        ix = torch.randint(len(d) - block, (batch,))
        x = torch.stack([torch.from_numpy(d[i:i + block].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(d[i + 1:i + 1 + block].astype(np.int64)) for i in ix])
        return x, y

    model = GPT(GPTConfig(block_size=block, vocab_size=65, n_layer=4, n_head=4, n_embd=128, dropout=0.0, bias=False))
    optimizer = torch.optim.AdamW(model.configure_optimizer_groups(0.1), lr=1e-3, betas=(0.9, 0.99), fused=False)

    def lr_at(it: int) -> float:
        if it < 100:
            return 1e-3 * (it + 1) / 101
        ratio = (it - 100) / (args.iters - 100)
        return 1e-4 + 0.5 * (1 + math.cos(math.pi * min(ratio, 1.0))) * (1e-3 - 1e-4)

    step_times = []
    for it in range(args.iters):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(it)
        t0 = time.perf_counter()
        x, y = get_batch("train")
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        step_times.append(time.perf_counter() - t0)
    model.eval()
    with torch.no_grad():
        val = statistics.mean(model(*get_batch("val"))[1].item() for _ in range(args.eval_iters))
    ms = 1e3 * statistics.median(step_times[len(step_times) // 10:])
    print(json.dumps({"ms_iter": ms, "tps": batch * block / (ms / 1e3), "val": val, "steps": args.iters,
                      "wall": time.time() - started}))


if __name__ == "__main__":
    main()
