"""`meshtrain sample --run DIR|FILE`: generate text on one process from a run's latest distributed
checkpoint (whatever layout wrote it: this process reads every shard) or from a `meshtrain export` file."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", required=True, type=Path,
                        help="a run directory (its latest checkpoint) or a model.pt written by `meshtrain export`")
    parser.add_argument("--prompt", default="What is an LLM?")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=200)
    parser.add_argument("--num-samples", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--device", default=None, help="auto, cpu, cuda ... (default: $MESHTRAIN_DEVICE or auto)")


def run(args: argparse.Namespace) -> int:
    # Imported here: torch, which `meshtrain sample --help` does without.
    import torch

    from meshtrain.data.tokenizers import tokenizer_from_meta
    from meshtrain.runtime.device import pick_device
    from meshtrain.train.checkpoint import load_language_model

    device = pick_device(0, args.device)
    model, meta = load_language_model(args.run, device)
    tokenizer = tokenizer_from_meta(meta)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    prompt = torch.tensor([tokenizer.encode(args.prompt)], dtype=torch.long, device=device)
    for i in range(args.num_samples):
        tokens = model.generate(prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                generator=generator)
        print(tokenizer.decode(tokens[0].tolist()))
        if i + 1 < args.num_samples:
            print("-" * 40)
    return 0
