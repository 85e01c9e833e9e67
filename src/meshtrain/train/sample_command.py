"""`meshtrain sample --run DIR|FILE`: generate text on one process from a run's latest distributed
checkpoint (whatever layout wrote it: this process reads every shard) or from a `meshtrain export` file."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from meshtrain.data.text import tokenizer_from_meta
from meshtrain.runtime.device import pick_device
from meshtrain.train import checkpoint


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


def load_model(run: Path, device: torch.device) -> tuple[torch.nn.Module, dict]:
    """The language model of a run's latest checkpoint (or of an exported file) and its tokenizer description."""
    if run.is_file():
        try:
            saved = torch.load(run, map_location="cpu", weights_only=True)
            weights = saved["model"]
        except Exception as e:
            raise checkpoint.CheckpointError(f"{run} is not a model file written by `meshtrain export`: {e}") from e
        model, facts = checkpoint.rebuild_model(saved)
        model.load_state_dict(weights)
    else:
        checkpoint_dir = checkpoint.latest_checkpoint(run)
        model, facts = checkpoint.rebuild_model(checkpoint.load_trainer_state(checkpoint_dir))
        checkpoint.load_whole_model(model, checkpoint_dir)
    if "meta" not in facts or not hasattr(model, "generate"):
        raise checkpoint.CheckpointError(f"{run} holds a {type(model).__name__}, not a language model: `meshtrain "
                                         "sample` generates text only")
    return model.to(device).eval(), facts["meta"]


def run(args: argparse.Namespace) -> int:
    device = pick_device(0, args.device)
    model, meta = load_model(args.run, device)
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
