"""The text data layer: shipped corpus, tokenizers, prepare (counts, idempotence, atomicity), errors, batches."""

from __future__ import annotations

import argparse
import gc
import hashlib
import logging
import os
import shutil
import weakref
from contextlib import contextmanager, nullcontext
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.unit.test_api import one_process

from meshtrain.commands import prepare as prepare_command
from meshtrain.config import load_config
from meshtrain.data import prepare_text, text
from meshtrain.data.prepare_text import prepare
from meshtrain.data.text import (
    CharTokenizer,
    DataError,
    GPT2Tokenizer,
    TokenBatches,
    check_split,
    load_meta,
    shakespeare_text,
)
from meshtrain.data.tokenizers import tokenizer_from_meta
from meshtrain.models import gpt
from meshtrain.models.language.workload import LanguageModelWorkload
from meshtrain.parallel.mesh import ParallelDims

SHAKESPEARE_CHARS = "\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
BPE_TOTAL_TOKENS = 338_025  # tiktoken's GPT-2 encoding of the whole corpus
SHARED_GPT2 = Path("/work/shared/data/gpt2-bpe")


@contextmanager
def captured_log():
    """The INFO lines the `meshtrain` logger emits inside the block (whatever configured it before)."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("meshtrain")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """Both Shakespeare datasets, prepared once per session into a temp data root, with their logs."""
    root = tmp_path_factory.mktemp("data")
    out = {"root": root}
    for name in ("shakespeare_char", "shakespeare"):
        with captured_log() as lines:
            meta = prepare(name, root)
        out[name] = (root / name, meta, lines)
    return out


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    prepare_command.add_arguments(parser)
    return parser.parse_args(list(argv))


def mtimes(data_dir: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in sorted(data_dir.iterdir())}


def contents(data_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(data_dir.iterdir())}


# ------------------------------------------------------------------------------------------ corpus + char


def test_shipped_corpus_is_tiny_shakespeare():
    corpus = shakespeare_text()
    assert hashlib.md5(corpus.encode("utf-8")).hexdigest() == "6fb458f1232090904fb40fe944165e91"
    assert len(corpus) == 1_115_394


def test_shakespeare_char_counts_and_log(prepared):
    data_dir, meta, lines = prepared["shakespeare_char"]
    assert "length of dataset in characters: 1,115,394" in lines
    assert "all the unique characters: " + repr(SHAKESPEARE_CHARS) in lines
    assert "vocab size: 65" in lines
    assert "train has 1,003,854 tokens" in lines
    assert "val has 111,540 tokens" in lines
    assert (meta["tokenizer"], meta["vocab_size"]) == ("char", 65)
    assert (meta["train_tokens"], meta["val_tokens"]) == (1_003_854, 111_540)
    assert meta["source_md5"] == "6fb458f1232090904fb40fe944165e91"
    assert (data_dir / "train.bin").stat().st_size == 2 * 1_003_854
    assert (data_dir / "val.bin").stat().st_size == 2 * 111_540
    assert load_meta(data_dir) == meta


def test_char_vocabulary_and_files_hold_the_text(prepared):
    data_dir, meta, _ = prepared["shakespeare_char"]
    tok = tokenizer_from_meta(meta)
    assert isinstance(tok, CharTokenizer)
    assert "".join(tok.itos) == SHAKESPEARE_CHARS and tok.vocab_size == 65
    assert tok.stoi == meta["stoi"] and tok.itos == meta["itos"]
    corpus = shakespeare_text()
    train = np.memmap(data_dir / "train.bin", dtype=np.uint16, mode="r")
    val = np.memmap(data_dir / "val.bin", dtype=np.uint16, mode="r")
    assert tok.decode(train) + tok.decode(val) == corpus  # first 90% train, the rest val, in order


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=SHAKESPEARE_CHARS))
def test_char_round_trip(s):
    tok = CharTokenizer(list(SHAKESPEARE_CHARS))
    ids = tok.encode(s)
    assert all(0 <= i < 65 for i in ids)
    assert tok.decode(ids) == s


def test_char_tokenizer_rejects_unknown_characters():
    with pytest.raises(ValueError, match="'é' is not in this 65-character vocabulary"):
        CharTokenizer(list(SHAKESPEARE_CHARS)).encode("café")


# --------------------------------------------------------------------------------------------------- BPE


def test_gpt2_tokenizer_offline():
    tok = GPT2Tokenizer()
    assert tok.vocab_size == 50257
    assert tok.encode("hello world") == [31373, 995]
    assert tok.decode([31373, 995]) == "hello world"
    assert tok.encoding.encode("<|endoftext|>", allowed_special="all") == [tok.eot_token]


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=200))
def test_gpt2_round_trip(s):
    tok = GPT2Tokenizer()
    assert tok.decode(tok.encode(s)) == s


def test_shakespeare_bpe_counts(prepared):
    data_dir, meta, lines = prepared["shakespeare"]
    corpus = shakespeare_text()
    tok = tokenizer_from_meta(meta)
    assert isinstance(tok, GPT2Tokenizer)
    assert len(tok.encoding.encode_ordinary(corpus)) == BPE_TOTAL_TOKENS
    assert meta["train_tokens"] + meta["val_tokens"] == BPE_TOTAL_TOKENS
    assert (meta["train_tokens"], meta["val_tokens"]) == (301_966, 36_059)  # text split at 90% of its chars
    assert "train has 301,966 tokens" in lines and "val has 36,059 tokens" in lines
    assert "vocab size: 50,257" in lines
    val = np.memmap(data_dir / "val.bin", dtype=np.uint16, mode="r")
    assert tok.decode(val) == corpus[int(len(corpus) * 0.9):]


def test_a_long_corpus_is_tokenized_in_pieces_with_the_same_ids_and_told(prepared, tmp_path, monkeypatch):
    """A corpus longer than a piece is encoded piece by piece (cut after a newline between letters, where
    GPT-2's pre-tokenizer cuts too), saying what it does and how far along it is: the ids are the whole's."""
    from meshtrain.runtime import progress

    monkeypatch.setattr(prepare_text, "ENCODE_PIECE_CHARS", 20_000)  # ~50 pieces of the 1.1M-character corpus
    monkeypatch.setattr(progress, "LINE_EVERY_S", 0.0)
    monkeypatch.setenv("MESHTRAIN_PROGRESS", "0")
    corpus = shakespeare_text()
    pieces = list(text._pieces(corpus, prepare_text.ENCODE_PIECE_CHARS))
    assert "".join(pieces) == corpus and len(pieces) > 40
    assert all(p[-1] == "\n" and p[-2].isalnum() for p in pieces[:-1])
    with captured_log() as lines:
        prepare("shakespeare", tmp_path, force=True)
    assert contents(tmp_path / "shakespeare") == contents(prepared["shakespeare"][0])
    assert "tokenizing the train split: 1,003,854 characters with gpt2" in lines
    told = [line for line in lines if line.startswith("tokenizing train, characters: ")]
    assert len(told) > 40 and told[-1].startswith("tokenizing train, characters: 1,003,854/1,003,854 (")


@pytest.mark.skipif(not (SHARED_GPT2 / "encoder.json").is_file(), reason="original GPT-2 vocab files not here")
def test_shipped_ranks_equal_the_original_gpt2_vocabulary(monkeypatch):
    import tiktoken.load

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # read the local files, cache nothing
    original = tiktoken.load.data_gym_to_mergeable_bpe_ranks(
        str(SHARED_GPT2 / "vocab.bpe"), str(SHARED_GPT2 / "encoder.json"))
    assert GPT2Tokenizer().encoding._mergeable_ranks == original


# ----------------------------------------------------------------------------------------- prepare text


@pytest.fixture
def user_text(tmp_path):
    path = tmp_path / "poems.txt"
    path.write_text("Roses are red,\nviolets are blue.\n" * 40 + "Ünïcödé ends it.\n", encoding="utf-8")
    return path


@pytest.mark.parametrize("kind", ["char", "gpt2"])
def test_prepare_text_file(tmp_path, user_text, kind):
    root = tmp_path / "root"
    assert prepare_command.run(parse("text", str(user_text), "--tokenizer", kind, "--data-root", str(root))) == 0
    data_dir = root / "poems"  # the file's stem
    meta = load_meta(data_dir)
    assert meta["tokenizer"] == kind and meta["source"] == str(user_text.resolve())
    tok = tokenizer_from_meta(meta)
    splits = [np.fromfile(data_dir / f"{s}.bin", dtype=np.uint16) for s in ("train", "val")]
    assert [len(ids) for ids in splits] == [meta["train_tokens"], meta["val_tokens"]]
    source = user_text.read_text(encoding="utf-8")
    assert tok.decode(splits[0]) + tok.decode(splits[1]) == source
    assert tok.decode(splits[1]) == source[int(len(source) * 0.9):]


def test_prepare_text_with_name_and_env_root(tmp_path, user_text, monkeypatch):
    monkeypatch.setenv("MESHTRAIN_DATA_ROOT", str(tmp_path / "envroot"))
    assert text.default_data_root() == tmp_path / "envroot"
    assert prepare_command.run(parse("text", str(user_text), "--name", "verses")) == 0
    assert load_meta(tmp_path / "envroot" / "verses")["tokenizer"] == "char"


def test_prepare_command_line_mistakes(tmp_path):
    assert prepare_command.run(parse("text", "--data-root", str(tmp_path))) == 2  # no PATH
    assert prepare_command.run(parse("shakespeare", "--tokenizer", "char", "--data-root", str(tmp_path))) == 2
    assert prepare_command.run(parse("text", str(tmp_path / "absent.txt"), "--data-root", str(tmp_path))) == 1
    assert not any(tmp_path.iterdir())


def test_a_vocabulary_beyond_uint16_writes_uint32_shards_and_a_narrower_one_train_bin_again(tmp_path):
    from meshtrain.data.shards import read_header, read_tokens
    from meshtrain.data.streams import dataset_meta

    path, out = tmp_path / "wide.txt", tmp_path / "root" / "wide"
    wide = "".join(chr(c) for c in range(0x10000, 0x10000 + 70_000))
    path.write_text(wide, encoding="utf-8")
    meta = prepare("text", tmp_path / "root", source=path)
    assert (meta["vocab_size"], meta["dtype"], meta["train_tokens"], meta["val_tokens"]) == (70_000, "uint32", 63_000, 7_000)
    assert read_header(out / "val_000000.bin").dtype == np.dtype("<u4") and not (out / "train.bin").exists()
    assert np.array_equal(read_tokens(out / "val_000000.bin"), np.arange(63_000, 70_000))  # the text's last 10%
    assert prepare("text", tmp_path / "root", source=path) == meta  # up to date: nothing written
    assert dataset_meta(out)["vocab_size"] == 70_000
    path.write_text("narrow text " * 20, encoding="utf-8")  # the same folder, a vocabulary that fits uint16
    assert prepare("text", tmp_path / "root", source=path)["vocab_size"] == 9
    assert (out / "train.bin").is_file() and not (out / "manifest.json").exists() and dataset_meta(out)["vocab_size"] == 9


# ----------------------------------------------------------------------------- idempotence + atomicity


def test_prepare_is_idempotent(tmp_path, user_text):
    root = tmp_path / "root"
    prepare("text", root, source=user_text)
    before = mtimes(root / "poems")
    with captured_log() as lines:
        prepare("text", root, source=user_text)
    assert mtimes(root / "poems") == before
    assert any("up to date" in line for line in lines)
    prepare("text", root, source=user_text, tokenizer="gpt2")  # another tokenizer: made again
    assert load_meta(root / "poems")["tokenizer"] == "gpt2"
    after_gpt2 = mtimes(root / "poems")
    prepare("text", root, source=user_text, tokenizer="gpt2", force=True)
    assert mtimes(root / "poems") != after_gpt2


def test_interrupted_write_keeps_the_old_dataset(tmp_path, user_text, monkeypatch):
    root = tmp_path / "root"
    prepare("text", root, source=user_text)
    old = contents(root / "poems")
    user_text.write_text("a different text, long enough to split into train and val\n" * 5, encoding="utf-8")

    def write_half_then_fail(file, tokens):
        file.write(tokens[: len(tokens) // 2].tobytes())
        raise OSError("No space left on device")

    monkeypatch.setattr(prepare_text, "_write_tokens", write_half_then_fail)
    with pytest.raises(OSError, match="No space left"):
        prepare("text", root, source=user_text)
    assert contents(root / "poems") == old  # same files, same bytes, no temp files left over


def test_crash_between_renames_reads_as_not_prepared(tmp_path, user_text, monkeypatch):
    root = tmp_path / "root"
    prepare("text", root, source=user_text)
    user_text.write_text("the second version of the text, again long enough\n" * 5, encoding="utf-8")
    real_replace, calls = os.replace, []

    def replace_once_then_die(src, dst):
        calls.append(dst)
        if len(calls) > 1:
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(prepare_text.os, "replace", replace_once_then_die)
    with pytest.raises(KeyboardInterrupt):
        prepare("text", root, source=user_text)
    monkeypatch.undo()
    assert sorted(p.name for p in (root / "poems").iterdir()) == ["train.bin", "val.bin"]
    with pytest.raises(DataError, match="meta.json not found"):
        load_meta(root / "poems")
    meta = prepare("text", root, source=user_text)  # and a re-run repairs it
    assert check_split(root / "poems", "train") == meta["train_tokens"]


# ------------------------------------------------------------------------------------------------- errors


def test_missing_dataset_names_path_and_command(tmp_path, monkeypatch):
    monkeypatch.delenv("MESHTRAIN_DATA_ROOT", raising=False)
    missing = tmp_path / "shakespeare_char"
    with pytest.raises(DataError) as e:
        TokenBatches(missing, "train", block_size=8, batch_size=2)
    assert str(missing) in str(e.value)
    assert f"meshtrain prepare shakespeare_char --data-root {tmp_path}" in str(e.value)

    monkeypatch.setenv("MESHTRAIN_DATA_ROOT", str(tmp_path))
    (tmp_path / "mytext").mkdir()
    with pytest.raises(DataError) as e:
        load_meta(tmp_path / "mytext")
    assert str(tmp_path / "mytext" / "meta.json") in str(e.value)
    assert "`meshtrain prepare text PATH --name mytext`" in str(e.value)


@pytest.fixture
def char_copy(prepared, tmp_path):
    """A private copy of shakespeare_char to damage."""
    data_dir = tmp_path / "shakespeare_char"
    shutil.copytree(prepared["shakespeare_char"][0], data_dir)
    return data_dir


def test_missing_bin_is_named(char_copy):
    (char_copy / "val.bin").unlink()
    with pytest.raises(DataError, match=r"val\.bin not found\. Run `meshtrain prepare shakespeare_char"):
        TokenBatches(char_copy, "val", block_size=8, batch_size=2)


def test_truncated_bins_are_named(char_copy):
    train = char_copy / "train.bin"
    os.truncate(train, train.stat().st_size - 1)
    with pytest.raises(DataError, match=r"train\.bin is truncated or corrupt: 2,007,707 bytes"):
        TokenBatches(char_copy, "train", block_size=8, batch_size=2)
    os.truncate(train, 2 * 1000)
    with pytest.raises(DataError, match=r"train\.bin holds 1,000 tokens but .*meta\.json expects 1,003,854"):
        TokenBatches(char_copy, "train", block_size=8, batch_size=2)


def test_token_ids_beyond_the_vocabulary_are_named(char_copy):
    val = char_copy / "val.bin"
    tokens = np.fromfile(val, dtype=np.uint16)
    tokens[1234] = 65  # the vocabulary is 0..64
    tokens.tofile(val)
    with pytest.raises(DataError, match=r"val\.bin holds token id 65, but .*meta\.json gives a vocabulary of 65 "
                                        r"\(ids 0\.\.64\).*Re-run `meshtrain prepare shakespeare_char"):
        TokenBatches(char_copy, "val", block_size=8, batch_size=2)
    tokens[1234] = 64
    tokens.tofile(val)
    TokenBatches(char_copy, "val", block_size=8, batch_size=2).next_batch()  # the largest id is fine


def test_block_size_longer_than_the_split(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("abcdefghij" * 10, encoding="utf-8")  # 100 chars: train 90 tokens, val 10
    prepare("text", tmp_path, source=path)
    TokenBatches(tmp_path / "short", "val", block_size=9, batch_size=2).next_batch()  # exactly fits
    with pytest.raises(DataError, match=r"block_size=10 needs windows of 11 tokens .* val split .* only 10 tokens"):
        TokenBatches(tmp_path / "short", "val", block_size=10, batch_size=2)


# ------------------------------------------------------------------------------------------------ batches


def test_batches_are_shifted_windows_of_the_file(prepared):
    data_dir = prepared["shakespeare_char"][0]
    tokens = np.memmap(data_dir / "train.bin", dtype=np.uint16, mode="r")
    offsets_source = TokenBatches(data_dir, "train", block_size=32, batch_size=6, seed=7)
    batches = TokenBatches(data_dir, "train", block_size=32, batch_size=6, seed=7)
    for _ in range(3):
        offsets = offsets_source.next_offsets()
        x, y = batches.next_batch()
        assert x.shape == y.shape == (6, 32) and x.dtype == y.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])
        for row, start in enumerate(offsets.tolist()):
            assert 0 <= start <= len(tokens) - 33
            window = torch.from_numpy(tokens[start:start + 33].astype(np.int64))
            assert torch.equal(x[row], window[:-1]) and torch.equal(y[row], window[1:])


def test_batches_repeat_from_the_seed_and_differ_across_ranks_and_splits(prepared):
    data_dir = prepared["shakespeare_char"][0]

    def offsets(seed=0, split="train", dp_rank=0, n=4):
        batches = TokenBatches(data_dir, split, block_size=64, batch_size=8, seed=seed, dp_rank=dp_rank, dp_size=2)
        return [batches.next_offsets() for _ in range(n)]

    assert all(torch.equal(a, b) for a, b in zip(offsets(), offsets(), strict=True))
    rank0 = {o for batch in offsets(dp_rank=0) for o in batch.tolist()}
    rank1 = {o for batch in offsets(dp_rank=1) for o in batch.tolist()}
    assert len(rank0) == len(rank1) == 32 and rank0.isdisjoint(rank1)
    assert not torch.equal(offsets(seed=1)[0], offsets(seed=0)[0])
    assert not torch.equal(offsets(split="val")[0], offsets(split="train")[0])


def _read(data_dir, dp_size, accum, steps, start=0):
    """Every rank's windows of global batches start.. start+steps-1 of one layout: {step: sorted offsets}."""
    read = {}
    for rank in range(dp_size):
        batches = TokenBatches(data_dir, "train", block_size=16, batch_size=12 // (dp_size * accum), seed=3,
                               dp_rank=rank, dp_size=dp_size, accum=accum)
        batches.seek(start)
        for step in range(start, start + steps):
            for _ in range(accum):
                read.setdefault(step, []).extend(batches.next_offsets().tolist())
            assert batches.step == step + 1 and batches.micro == 0
    return {step: sorted(offsets) for step, offsets in read.items()}


def test_every_layout_with_one_global_batch_reads_the_same_windows(prepared):
    data_dir = prepared["shakespeare"][0]
    reference = _read(data_dir, dp_size=4, accum=1, steps=5)  # 4 ranks × 3 windows
    assert all(len(offsets) == 12 for offsets in reference.values())
    for dp_size, accum in [(2, 2), (1, 4), (2, 1), (1, 1), (4, 3)]:  # the last two read other global batches
        batch = 12 // (dp_size * accum) * dp_size * accum
        read = _read(data_dir, dp_size, accum, steps=5)
        assert (read == reference) == (batch == 12), (dp_size, accum)
    # the position is the global batch number alone: a stream started at step 3 reads what step 3 read
    assert _read(data_dir, dp_size=2, accum=2, steps=2, start=3) == {s: reference[s] for s in (3, 4)}
    stream = TokenBatches(data_dir, "train", block_size=16, batch_size=3, seed=3, dp_size=4)
    assert sorted(stream.global_offsets(4).tolist()) == reference[4]


def test_meshtrain_prepare_through_the_cli(prepared, capsys):
    from meshtrain import commands

    logger = logging.getLogger("meshtrain")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    try:
        assert commands.main(["prepare", "shakespeare_char", "--data-root", str(prepared["root"])]) == 0
    finally:  # commands.main pointed the logger at this test's captured stdout: put it back
        logger.handlers[:], logger.level, logger.propagate = saved
    assert "shakespeare_char is up to date" in capsys.readouterr().out


def test_a_sample_builds_its_copy_of_the_model_and_keeps_none(prepared):
    """After an evaluation rank 0 samples from a whole copy of the model: built for that sample and dropped after
    it, so that it is not held beside every later step on rank 0's device (the planner's peaks, a 7B model's 28 GB
    on one rank of an FSDP job). The same iteration sampled again gives the same text from a fresh copy."""
    cfg = load_config(["model.n_layer=1", "model.n_head=2", "model.n_embd=32", "model.block_size=16",
                       f"data.root={prepared['root']}", "train.sample_tokens=8"], "gpt")
    workload = LanguageModelWorkload(cfg, one_process(), ParallelDims(), build_model=gpt.SPEC.build_model,
                                     build_layout=gpt.SPEC.build_layout)
    torch.manual_seed(0)
    layout = workload.build_layout(workload.build_model(), None)
    copies, factory = [], workload.sampler_factory  # weak references: the test holds none of them
    workload.sampler_factory = lambda: (copy := factory(), copies.append(weakref.ref(copy)))[0]
    texts = []
    for _ in range(2):
        result, sinks = SimpleNamespace(samples=[]), SimpleNamespace(log_text=lambda *args: None)
        workload.after_eval(7, layout, nullcontext(), sinks, result)
        texts += result.samples
    gc.collect()
    assert len(copies) == 2 and all(ref() is None for ref in copies)  # one a sample, neither alive after it
    assert texts[0] == texts[1] and texts[0].startswith(cfg.train.prompt) and len(texts[0]) > len(cfg.train.prompt)
