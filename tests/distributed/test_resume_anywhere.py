"""Resume anywhere, exactly: a run saved under ddp on 4 ranks and resumed at iteration 10 on 2 ranks (accumulation
doubled by train.global_batch_size), under fsdp × tp2 and under ddp × pp2 (the ViT: ddp × cp2) on 4 follows the
uninterrupted 4-rank run: every iteration's loss and every evaluation within 1e-4, and the sample ledger identical
(the same samples, none skipped, none repeated). fp32, no dropout (its masks are drawn per rank). The GPT trains on a
sharded corpus (issue 45): 20+ shards of Shakespeare's speeches as jsonl documents, tokenized by a byte-level BPE
trained on them in the fixture (`meshtrain prepare tokenizer`'s), read in data.order=epoch (a shuffled pass over the
documents an epoch; the resumed part crosses into the second epoch), with the evaluations' random windows over the
same shards. The same layout's
bit-exact resumes: test_train_gpt.py, test_train_llama.py (on 4 ranks DDP's first backward after a start buckets
its gradients in parameter order, later ones in the order they came, and a ring all-reduce of 4 adds each element
in an order that follows its place in its bucket: the ViT on 4 ranks resumed in its own layout differed by 3e-8)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from tests import preloaded
from tests.conftest import REPO, RESUMABLE_GPT, clean_env, fork_ranks, output, rewound_copy

from meshtrain.data.text import shakespeare_text
from meshtrain.train.ledger import read_ledger

pytestmark = pytest.mark.slow

VIT = ["train", "vit", "preset=tiny", "model.patch_size=4", "model.embed_dim=32", "model.depth=2", "model.num_heads=4",
       "data.crop=[32,64]", "train.dtype=fp32", "train.eval_iters=2", "optimizer.warmup_iters=0", "optimizer.lr=3e-3",
       "optimizer.min_lr=3e-4", "optimizer.lr_decay_iters=30", "train.max_epochs=null", "data.batch_size=2",
       "train.global_batch_size=8", "data.limit_train=100", "train.max_iters=30", "train.eval_interval=10",
       "train.log_interval=1", "train.sample_ledger=true", "train.keep_checkpoints=0"]  # 12 iterations an epoch
SHARDED = "shakespeare_bpe"
GPT = [*RESUMABLE_GPT, f"data.name={SHARDED}", "data.order=epoch"]
CORPUS_CHARS, SHARD_TOKENS, BPE_VOCAB = 30_000, 400, 512  # 13.6k train tokens in 35 shards: 480 windows, 1.2 epochs
RESUMED_INTO = {  # (ranks, overrides) of each resume
    "gpt": [(2, ["train.backend=ddp"]), (4, ["train.backend=fsdp", "parallel.tp=2"]),
            (4, ["train.backend=ddp", "parallel.pp=2"])],
    "vit": [(2, ["train.backend=ddp"]), (4, ["train.backend=fsdp", "parallel.tp=2"]),
            (4, ["train.backend=ddp", "parallel.cp=2", "parallel.cp_impl=ring"])],
}


def sharded_corpus(root: Path) -> dict:
    """Shakespeare's first CORPUS_CHARS characters as jsonl, a speech a document, tokenized by a BPE trained on
    them into shards of SHARD_TOKENS tokens under root/SHARDED (in this process: no launch); the manifest."""
    from meshtrain.data.corpus import prepare_corpus
    from meshtrain.data.tokenizers import train_bpe

    text = shakespeare_text()[:CORPUS_CHARS]
    (root / "plays.txt").write_text(text, encoding="utf-8")
    (root / "plays.jsonl").write_text("".join(json.dumps({"text": speech + "\n\n"}) + "\n"
                                              for speech in text.split("\n\n")), encoding="utf-8")
    train_bpe([root / "plays.txt"], BPE_VOCAB, root / "bpe.json")
    return prepare_corpus([root / "plays.jsonl"], root / SHARDED, str(root / "bpe.json"), workers=1,
                          shard_tokens=SHARD_TOKENS)


@pytest.fixture(scope="module")
def uninterrupted_gpt_on_shards(tmp_path_factory) -> tuple[Path, Path]:
    """(the data root, the run directory) of GPT under ddp on 4 ranks over the sharded corpus, never interrupted."""
    root = tmp_path_factory.mktemp("sharded_gpt_data")
    manifest = sharded_corpus(root)
    assert len(manifest["splits"]["train"]["shards"]) >= 20 and manifest["tokenizer"]["tokenizer"] == "huggingface"
    out_dir = tmp_path_factory.mktemp("uninterrupted_gpt")
    train(4, [*GPT, f"data.root={root}"], out_dir, "train.backend=ddp", "train.async_checkpoint=true")
    return root, (out_dir / "gpt" / "ddp" / "latest").resolve()


@pytest.fixture(scope="module")
def uninterrupted_vit(tmp_path_factory) -> tuple[Path, Path]:
    """(the data root, the run directory) of VIT under ddp on 4 ranks, never interrupted; the runs cross two epochs."""
    from meshtrain.data.era5_synthetic import generate

    era5 = tmp_path_factory.mktemp("era5")
    generate(era5, years=[2015, 2016, 2017, 2018], samples_per_year=60, grid=(34, 66), channels=4, seed=0)
    out_dir = tmp_path_factory.mktemp("uninterrupted_vit")
    train(4, [*VIT, f"data.root={era5}"], out_dir, "train.backend=ddp", "train.async_checkpoint=true")
    return era5, (out_dir / "vit" / "ddp" / "latest").resolve()


def train(ranks: int, args: list[str], out_dir: Path, *overrides: str):
    run = fork_ranks(ranks, *args, f"train.out_dir={out_dir}", *overrides, timeout=300)
    assert run.returncode == 0, output(run)[-3000:]
    return run


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("model", ["gpt", "vit"])
def test_a_run_resumed_in_another_layout_goes_on_as_if_uninterrupted(model, request, tmp_path):
    data_root, full_dir = request.getfixturevalue("uninterrupted_gpt_on_shards" if model == "gpt" else
                                                  "uninterrupted_vit")
    args = [*(GPT if model == "gpt" else VIT), f"data.root={data_root}"]
    want, want_ledger = rows(full_dir), read_ledger(full_dir / "ledger.txt")
    assert sorted(want_ledger) == list(range(30)) and all(len(ids) == (16 if model == "gpt" else 8)
                                                            for ids in want_ledger.values())
    if model == "gpt":  # data.order=epoch: sample k is window k of the stream of epochs, and the run crosses one
        assert [i for step in range(30) for i in want_ledger[step]] == list(range(480))
        manifest = json.loads((data_root / SHARDED / "manifest.json").read_text())
        assert 16 * 10 < manifest["splits"]["train"]["tokens"] // 33 < 480  # epoch 1 starts after the resume
    if model == "vit":  # the same 100 samples in each epoch, none twice within one
        epoch = [i for step in range(12) for i in want_ledger[step]]
        assert len(set(epoch)) == len(epoch) == 96 and set(epoch) <= set(range(100))

    for number, (ranks, layout) in enumerate(RESUMED_INTO[model]):
        split = rewound_copy(full_dir, tmp_path / f"split{number}", 10)
        run = train(ranks, args, tmp_path / "resumed", *layout, "train.init_from=resume", f"train.run_dir={split}")
        text = output(run)
        assert "resuming at iteration 10" in text and "model, optimizer and data go on exactly" in text, text[-3000:]
        for step, key in [(s, "loss") for s in range(11, 31)] + [(20, "val_loss"), (30, "val_loss")]:
            got = next(r[key] for r in rows(split) if r["step"] == step and key in r)
            expected = next(r[key] for r in want if r["step"] == step and key in r)
            assert got == pytest.approx(expected, rel=1e-4), (layout, step, key, got, expected)
        assert read_ledger(split / "ledger.txt") == want_ledger, layout

    if model == "gpt":  # export consolidates the last checkpoint of the pipelined run, which sample reads, with
        # the tokenizer.json moved away: the run and model.pt carry its text
        tokenizer = data_root / "bpe.json"
        tokenizer.rename(data_root / "bpe.json.moved")
        try:
            sampled = [preloaded.run([sys.executable, "-m", "meshtrain", *command], env=clean_env(), cwd=REPO,
                                     timeout=120)
                       for command in (["export", "--run", str(split)],
                                       ["sample", "--run", str(split / "model.pt"), "--prompt", "ROMEO:",
                                        "--max-new-tokens", "20", "--seed", "3"],
                                       ["sample", "--run", str(split), "--prompt", "ROMEO:", "--max-new-tokens", "20",
                                        "--seed", "3"])]
        finally:
            (data_root / "bpe.json.moved").rename(tokenizer)
        assert all(s.returncode == 0 for s in sampled), "".join(output(s) for s in sampled)
        assert sampled[1].stdout.startswith("ROMEO:") and sampled[1].stdout == sampled[2].stdout
    else:  # export rebuilds any model from its spec; sample generates text only
        export, sample = (preloaded.run([sys.executable, "-m", "meshtrain", command, "--run", str(split)],
                                        env=clean_env(), cwd=REPO, timeout=120)
                          for command in ("export", "sample"))
        assert export.returncode == 0, output(export)
        import torch

        saved = torch.load(split / "model.pt", weights_only=True)
        assert saved["iteration"] == 30 and saved["workload"] == "meshtrain.models.vit:SPEC"
        assert sample.returncode == 1 and "holds a ViT, not a language model" in output(sample)
