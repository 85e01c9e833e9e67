"""`meshtrain sample --run DIR`: generate text from a run's checkpoint, on one process."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from meshtrain.config import from_dict
from meshtrain.data.text import tokenizer_from_meta
from meshtrain.dist.device import pick_device
from meshtrain.models.gpt import GPT, GPTConfig
from meshtrain.train import checkpoint


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", required=True, type=Path, help="a run directory (holding ckpt.pt)")
    parser.add_argument("--prompt", default="What is an LLM?")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=200)
    parser.add_argument("--num-samples", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--device", default=None, help="auto, cpu, cuda ... (default: $MESHTRAIN_DEVICE or auto)")


def load_model(run_dir: Path, device: torch.device) -> tuple[GPT, dict]:
    """The model of a run's checkpoint and the tokenizer description saved with it."""
    state = checkpoint.load(run_dir)
    m = from_dict(state["config"]).model
    model = GPT(GPTConfig(block_size=m.block_size, vocab_size=state["meta"]["vocab_size"], n_layer=m.n_layer,
                          n_head=m.n_head, n_embd=m.n_embd, dropout=0.0, bias=m.bias, activation=m.activation))
    model.load_state_dict(state["model"])
    return model.to(device).eval(), state["meta"]


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
