"""Tokens per second of `prepare text PATH…` (data/corpus.py) with 1 and 2 workers, against a plain loop of the same
tokenizer over the same documents, and the peak resident memory of each.

    python benchmarks/prepare_corpus.py                        # 200 M characters of generated jsonl, GPT-2 BPE
    python benchmarks/prepare_corpus.py --chars 20M --workers 1 2 4
    python benchmarks/prepare_corpus.py --chars 200M --files 16 --generate-only /tmp/corpus   # jsonl(.gz)+parquet

The corpus is generated once into a temporary folder (words drawn from a fixed vocabulary, documents of 1–8 K
characters, --seed). Each row runs in a fresh interpreter, so its peak resident memory (getrusage: the process's
own, and the largest of its worker processes') is its own. The plain loop reads the jsonl and calls
`encode` per document in one process, writing nothing: the ceiling of one core, which the workers should beat.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

UNITS = {"K": 10**3, "M": 10**6, "G": 10**9}


def count(text: str) -> int:
    """'200M' -> 200_000_000."""
    text = text.strip().upper()
    return int(float(text[:-1]) * UNITS[text[-1]]) if text[-1] in UNITS else int(text)


def generate(path: Path, chars: int, seed: int) -> int:
    """A jsonl corpus of about `chars` characters of word-like text; the number of documents."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    vocabulary = ["".join(rng.choice(letters, rng.integers(1, 11))) for _ in range(20_000)]
    words = np.array(vocabulary)
    written, docs = 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < chars:
            picks = words[rng.zipf(1.3, rng.integers(150, 1_200)) % len(words)]
            text = " ".join(picks.tolist()).capitalize() + ".\n"
            f.write(json.dumps({"text": text}) + "\n")
            written, docs = written + len(text), docs + 1
    return docs


def shakespeare_documents(chars: int, seed: int, names: int = 200_000) -> Iterator[str]:
    """Documents of about 1–8 K characters from the shipped Shakespeare, reshuffled: speeches (the text under a
    speaker's line, up to the blank line) drawn at random, each under one of `names` invented speaker names
    (2–4 syllables, Zipf-drawn), so that a BPE trained on a slice finds merges past 65,536 tokens (Shakespeare's
    own words give far fewer). Yields texts until `chars` characters."""
    import gzip
    from importlib.resources import files

    raw = files("meshtrain.data").joinpath("assets", "tinyshakespeare.txt.gz").read_bytes()
    speeches = [s.split("\n", 1)[1] for s in gzip.decompress(raw).decode("utf-8").split("\n\n") if "\n" in s]
    rng = np.random.default_rng(seed)
    onsets = ["", "b", "br", "c", "ch", "d", "dr", "f", "g", "gr", "h", "j", "k", "l", "m", "n", "p", "pr", "r",
              "s", "st", "t", "th", "tr", "v", "w", "z"]
    vowels = ["a", "e", "i", "o", "u", "ae", "ia", "ou", "ei"]
    codas = ["", "", "n", "r", "s", "l", "th", "nd", "st"]
    syllables = np.array([o + v + c for o in onsets for v in vowels for c in codas])
    pool = ["".join(rng.choice(syllables, rng.integers(2, 5))).upper() for _ in range(names)]
    written = 0
    while written < chars:
        parts, size, goal = [], 0, rng.integers(1_000, 8_000)
        while size < goal:
            name = pool[(rng.zipf(1.2) - 1) % names]
            parts.append(f"{name}:\n{speeches[rng.integers(len(speeches))]}\n\n")
            size += len(parts[-1])
        written += size
        yield "".join(parts)


def generate_files(folder: Path, chars: int, seed: int, files: int, formats: list[str]) -> list[Path]:
    """`files` files of `shakespeare_documents` in `folder`, about `chars` characters in all, the formats taken
    in turn (jsonl or parquet; every second jsonl gzip-compressed); their paths."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    documents = shakespeare_documents(chars, seed)
    paths, per_file = [], chars // files
    for i in range(files):
        kind = formats[i % len(formats)]
        texts, size = [], 0
        for text in documents:
            texts.append(text)
            size += len(text)
            if size >= per_file and i < files - 1:
                break
        if kind == "parquet":
            path = folder / f"part-{i:03d}.parquet"
            pq.write_table(pa.table({"text": texts}), path, row_group_size=2_000)
        else:
            gz = (i // len(formats)) % 2 == 1
            path = folder / f"part-{i:03d}.jsonl{'.gz' if gz else ''}"
            with (gzip.open(path, "wt", encoding="utf-8") if gz else open(path, "w", encoding="utf-8")) as f:
                f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
        paths.append(path)
    return paths


def run_one(mode: str, corpus: Path, out: Path) -> dict:
    """One row, in this (fresh) process: tokens, seconds and peak memory."""
    from meshtrain.data.corpus import prepare_corpus
    from meshtrain.data.tokenizers import load_tokenizer

    tok = load_tokenizer("gpt2")
    start = time.perf_counter()
    if mode == "loop":
        tokens = 0
        with open(corpus, encoding="utf-8") as f:
            for line in f:
                tokens += len(tok.encode(json.loads(line)["text"])) + 1  # + the end-of-text token
    else:
        manifest = prepare_corpus([corpus], out, tok, workers=int(mode), val_fraction=0.01, force=True)
        tokens = sum(manifest["splits"][s]["tokens"] for s in ("train", "val"))
    seconds = time.perf_counter() - start
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {"tokens": tokens, "seconds": seconds, "rss_mib": own, "worker_rss_mib": children}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chars", type=count, default=count("200M"), help="corpus size in characters (200M)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts to time (1 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--files", type=int, default=1, help="with --generate-only: the number of files (1)")
    parser.add_argument("--formats", default="jsonl,parquet", help="with --generate-only: the formats in turn")
    parser.add_argument("--generate-only", metavar="FOLDER", type=Path,
                        help="write a corpus of reshuffled Shakespeare into FOLDER and stop (no timing)")
    parser.add_argument("--run", nargs=3, metavar=("MODE", "CORPUS", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        print(json.dumps(run_one(args.run[0], Path(args.run[1]), Path(args.run[2]))))
        return
    if args.generate_only:
        paths = generate_files(args.generate_only, args.chars, args.seed, args.files, args.formats.split(","))
        print(f"wrote {len(paths)} files, {sum(p.stat().st_size for p in paths) / 2**20:,.0f} MiB, "
              f"to {args.generate_only}")
        return
    with tempfile.TemporaryDirectory(prefix="prepare_corpus_") as tmp:
        corpus = Path(tmp) / "corpus.jsonl"
        docs = generate(corpus, args.chars, args.seed)
        print(f"corpus: {args.chars:,} characters in {docs:,} documents ({corpus.stat().st_size / 2**20:,.0f} MiB "
              "jsonl), GPT-2 BPE")
        rows = [("plain loop, encode per document", "loop")]
        rows += [(f"prepare, {n} worker(s)", str(n)) for n in args.workers]
        print(f"| {'run':<32} | {'tokens':>12} | {'seconds':>8} | {'tokens/s':>10} | {'peak RSS MiB':>12} | "
              f"{'worker peak MiB':>15} |")
        print(f"|{'-' * 34}|{'-' * 14}|{'-' * 10}|{'-' * 12}|{'-' * 14}|{'-' * 17}|")
        for label, mode in rows:
            done = subprocess.run([sys.executable, __file__, "--run", mode, str(corpus), str(Path(tmp) / "out")],
                                  capture_output=True, text=True, check=True)
            row = json.loads(done.stdout.strip().splitlines()[-1])
            workers = f"{row['worker_rss_mib']:,.0f}" if mode not in ("loop", "1") else "-"
            print(f"| {label:<32} | {row['tokens']:>12,} | {row['seconds']:>8.1f} | "
                  f"{row['tokens'] / row['seconds']:>10,.0f} | {row['rss_mib']:>12,.0f} | {workers:>15} |", flush=True)


if __name__ == "__main__":
    main()
