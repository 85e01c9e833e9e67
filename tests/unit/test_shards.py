"""Sharded corpora: the shard format, `prepare text PATH…` (formats, workers, split, resume), llm.c shards, and the
reader the trainer draws windows from (data/shards.py, data/corpus.py). Small fake tokenizers keep it fast."""

from __future__ import annotations

import argparse
import gzip
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from meshtrain.commands import prepare as prepare_command
from meshtrain.data import corpus, corpus_sources, shards
from meshtrain.data.corpus import index_bin_shards, is_val, prepare_corpus
from meshtrain.data.shards import (
    HEADER_BYTES,
    ShardBatches,
    ShardedTokens,
    decode_header,
    encode_header,
    read_header,
    read_tokens,
    write_llmc_shard,
)
from meshtrain.data.streams import EpochBatches, token_batches
from meshtrain.data.text import DataError, TokenBatches
from meshtrain.data.tokenizers import Tokenizer


class ByteTokenizer(Tokenizer):
    """A document's UTF-8 bytes, and 256 between documents: every token says where it came from."""

    kind, spec, eot_id, vocab_size, fingerprint = "bytes", "bytes", 256, 257, "b" * 64

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8")


class WideTokenizer(ByteTokenizer):
    """Ids past uint16: the shards must hold them as uint32."""

    kind, spec, eot_id, vocab_size, fingerprint = "wide", "wide", 69_999, 70_000, "w" * 64

    def encode(self, text: str) -> list[int]:
        return [65_000 + b for b in text.encode("utf-8")]


DOCS = [f"document {i}: " + "lorem ipsum " * (i % 7 + 1) for i in range(120)]


def expected_split(docs, split, val_fraction=0.1, eot=256, shift=0):
    """The tokens a split must hold: its documents whole, in order, each after the end-of-text token."""
    ids = []
    for number, doc in enumerate(docs):
        if is_val(number, val_fraction) == (split == "val"):
            ids += [eot] + [shift + b for b in doc.encode()]
    return np.array(ids)


def split_tokens(out: Path, split: str) -> np.ndarray:
    manifest = json.loads((out / "manifest.json").read_text())
    parts = [np.asarray(read_tokens(out / e["path"])) for e in manifest["splits"][split]["shards"]]
    return np.concatenate(parts) if parts else np.array([], dtype=np.int64)


def shard_bytes(out: Path) -> dict[str, bytes]:
    """The shards and their document indexes."""
    return {p.name: p.read_bytes() for p in sorted([*out.glob("*.bin"), *out.glob("*.idx")])}


@pytest.fixture
def jsonl_gz(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "CHUNK_CHARS", 300)  # many chunks, so the workers' order matters
    path = tmp_path / "in" / "docs.jsonl.gz"
    path.parent.mkdir()
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": doc, "id": i}) + "\n" for i, doc in enumerate(DOCS))
    return path


def test_header_round_trip_both_widths():
    for dtype in (np.dtype("<u2"), np.dtype("<u4")):
        header = decode_header(encode_header(12_345, dtype, "ab" * 32), Path("x.bin"))
        assert (header.format, header.dtype, header.count, header.fingerprint) == ("meshtrain", dtype, 12_345, "ab" * 32)
    assert len(encode_header(1, np.dtype("<u2"), "f" * 64)) == HEADER_BYTES


def test_jsonl_gz_documents_whole_in_their_split_and_shards_of_the_given_size(jsonl_gz, tmp_path):
    manifest = prepare_corpus([jsonl_gz], tmp_path / "out", ByteTokenizer(), workers=1, shard_tokens=500)
    for split in ("train", "val"):
        assert np.array_equal(split_tokens(tmp_path / "out", split), expected_split(DOCS, split))
        sizes = [e["tokens"] for e in manifest["splits"][split]["shards"]]
        assert all(size == 500 for size in sizes[:-1]) and 0 < sizes[-1] <= 500
    assert manifest["tokenizer"]["vocab_size"] == 257 and manifest["dtype"] == "uint16"
    assert 0 < sum(is_val(d, 0.1) for d in range(len(DOCS))) < len(DOCS)


def test_the_same_shards_prepared_twice_and_with_one_or_two_workers(jsonl_gz, tmp_path):
    prepare_corpus([jsonl_gz], tmp_path / "a", ByteTokenizer(), workers=1, shard_tokens=400)
    prepare_corpus([jsonl_gz], tmp_path / "b", ByteTokenizer(), workers=1, shard_tokens=400, force=True)
    prepare_corpus([jsonl_gz], tmp_path / "c", ByteTokenizer(), workers=2, shard_tokens=400)
    assert shard_bytes(tmp_path / "a") == shard_bytes(tmp_path / "b") == shard_bytes(tmp_path / "c")
    assert len(shard_bytes(tmp_path / "a")) > 4


def test_uint32_shards_where_the_vocabulary_outgrows_uint16(tmp_path):
    (tmp_path / "a.txt").write_text("wide ids\n")
    (tmp_path / "b.txt").write_text("more wide ids\n")
    manifest = prepare_corpus([tmp_path / "*.txt"], tmp_path / "out", WideTokenizer(), workers=1,
                              val_fraction=0.0, shard_tokens=8)
    assert manifest["dtype"] == "uint32"
    first = manifest["splits"]["train"]["shards"][0]
    assert read_header(tmp_path / "out" / first["path"]).dtype == np.dtype("<u4")
    docs = ["wide ids\n", "more wide ids\n"]
    assert np.array_equal(split_tokens(tmp_path / "out", "train"), expected_split(docs, "train", 0.0, 69_999, 65_000))


def test_plain_text_zstd_and_parquet_inputs(tmp_path, monkeypatch):
    zstandard = pytest.importorskip("zstandard", reason="zstd input needs zstandard (the corpus extra)")
    pq = pytest.importorskip("pyarrow.parquet", reason="parquet input needs pyarrow (the corpus extra)")
    import pyarrow as pa

    monkeypatch.setattr(corpus_sources, "ENCODE_PIECE_CHARS", 64)  # a long text file read in pieces
    src = tmp_path / "src"
    src.mkdir()
    long_text = "".join(f"line {i} of a long book\n" for i in range(200))
    (src / "a_book.txt").write_text(long_text)
    (src / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        "".join(json.dumps({"body": d}) + "\n" for d in DOCS[:30]).encode()))
    pq.write_table(pa.table({"body": DOCS[30:60], "n": list(range(30))}), src / "c.parquet")
    prepare_corpus([src], tmp_path / "out", ByteTokenizer(), field="body", workers=1, shard_tokens=1000)
    docs = [long_text, *DOCS[:60]]
    for split in ("train", "val"):
        assert np.array_equal(split_tokens(tmp_path / "out", split), expected_split(docs, split))


def test_a_missing_field_is_named_with_its_line(jsonl_gz, tmp_path):
    with pytest.raises(DataError, match=r"docs.jsonl.gz:1 .*'body'.*--field"):
        prepare_corpus([jsonl_gz], tmp_path / "out", ByteTokenizer(), field="body", workers=1)


def test_resume_after_a_kill_keeps_the_finished_shards(jsonl_gz, tmp_path, monkeypatch):
    clean, out = tmp_path / "clean", tmp_path / "out"
    prepare_corpus([jsonl_gz], clean, ByteTokenizer(), workers=1, shard_tokens=300)
    calls, real = [], corpus._write_json

    def killed_after_four_shards(path, value):
        calls.append(path)
        if len(calls) == 5:
            raise KeyboardInterrupt  # the kill, right after a fifth shard was renamed into place
        real(path, value)

    monkeypatch.setattr(corpus, "_write_json", killed_after_four_shards)
    with pytest.raises(KeyboardInterrupt):
        prepare_corpus([jsonl_gz], out, ByteTokenizer(), workers=1, shard_tokens=300)
    monkeypatch.setattr(corpus, "_write_json", real)
    progress = json.loads((out / corpus.PROGRESS).read_text())
    finished = [e["path"] for split in ("train", "val") for e in progress["shards"][split]]
    assert len(finished) == 4 and not (out / "manifest.json").exists()
    os.remove(out / progress["shards"]["train"][-1]["path"])  # the last finished shard lost as well
    (out / ".train_000099.bin.tmp").write_bytes(b"half a shard")
    kept = {name: (out / name).stat().st_mtime_ns for name in finished if (out / name).exists()}

    prepare_corpus([jsonl_gz], out, ByteTokenizer(), workers=1, shard_tokens=300)
    assert shard_bytes(out) == shard_bytes(clean)
    assert {name: (out / name).stat().st_mtime_ns for name in kept} == kept  # not rewritten
    assert not list(out.glob(".*.tmp")) and not (out / corpus.PROGRESS).exists()


def test_llmc_shards_read_back_exactly_and_other_magics_refused(tmp_path):
    rng = np.random.default_rng(0)
    train, val = rng.integers(0, 50_257, 3_000), rng.integers(0, 50_257, 500)
    write_llmc_shard(tmp_path / "fineweb_train_000001.bin", train[:1_800])
    write_llmc_shard(tmp_path / "fineweb_train_000002.bin", train[1_800:])
    write_llmc_shard(tmp_path / "fineweb_val_000000.bin", val)
    header = read_header(tmp_path / "fineweb_val_000000.bin")
    assert (header.format, header.count, header.dtype) == ("llm.c", 500, np.dtype("<u2"))
    files = sorted(tmp_path.glob("fineweb_*.bin"))
    index_bin_shards(files, tmp_path / "indexed", tokenizer=WideTokenizer())
    assert np.array_equal(ShardedTokens(tmp_path / "indexed", "train").read(0, 3_000), train)
    assert np.array_equal(ShardedTokens(tmp_path / "indexed", "val").read(0, 500), val)

    raw = bytearray((tmp_path / "fineweb_val_000000.bin").read_bytes())
    raw[4:8] = np.int32(2).tobytes()
    (tmp_path / "v2.bin").write_bytes(bytes(raw))
    with pytest.raises(DataError, match="version 2"):
        read_header(tmp_path / "v2.bin")
    (tmp_path / "foreign.bin").write_bytes(b"PK\x03\x04" + bytes(2_000))
    with pytest.raises(DataError, match="foreign.bin is not a token shard"):
        read_header(tmp_path / "foreign.bin")


def test_a_truncated_foreign_or_missing_shard_is_one_error_at_start_up(jsonl_gz, tmp_path):
    out = tmp_path / "out"
    manifest = prepare_corpus([jsonl_gz], out, ByteTokenizer(), workers=1, shard_tokens=400)
    second = out / manifest["splits"]["train"]["shards"][1]["path"]
    whole = second.read_bytes()
    second.write_bytes(whole[:-10])
    with pytest.raises(DataError, match=rf"{second.name} is truncated.*prepare the corpus again"):
        ShardBatches(out, "train", block_size=8, batch_size=2)
    write_llmc_shard(second, np.zeros(400))
    with pytest.raises(DataError, match=rf"{second.name} holds another tokenizer's tokens"):
        ShardBatches(out, "train", block_size=8, batch_size=2)
    second.unlink()
    with pytest.raises(DataError, match=rf"{second.name} not found"):
        ShardBatches(out, "train", block_size=8, batch_size=2)
    second.write_bytes(whole)
    listed = json.loads((out / "manifest.json").read_text())
    listed["splits"]["train"]["shards"][1]["tokens"] += 1
    (out / "manifest.json").write_text(json.dumps(listed))
    with pytest.raises(DataError, match=rf"{second.name} holds 400 tokens where the manifest says 401"):
        ShardBatches(out, "train", block_size=8, batch_size=2)
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert shards.verify(out) == []
    second.write_bytes(whole[:-1] + bytes([whole[-1] ^ 1]))
    assert [p for p in shards.verify(out) if "sha256" in p]


def test_windows_across_shard_boundaries_equal_one_concatenated_array(jsonl_gz, tmp_path):
    prepare_corpus([jsonl_gz], tmp_path / "out", ByteTokenizer(), workers=1, shard_tokens=97)
    whole = expected_split(DOCS, "train")
    tokens = ShardedTokens(tmp_path / "out", "train")
    assert tokens.num_tokens == len(whole) and len(tokens.paths) > 5
    for start in range(0, len(whole) - 250, 13):
        assert np.array_equal(tokens.read(start, 250), whole[start:start + 250])


def test_the_draw_of_an_iteration_is_the_same_for_every_data_parallel_degree(jsonl_gz, tmp_path):
    prepare_corpus([jsonl_gz], tmp_path / "out", ByteTokenizer(), workers=1, shard_tokens=100)

    def rows(dp_size, accum, step=3, order="random"):
        out = []
        for micro in range(accum):
            for rank in range(dp_size):
                batches = token_batches(tmp_path / "out", "train", order=order, block_size=16,
                                        batch_size=8 // (dp_size * accum), seed=5, dp_rank=rank, dp_size=dp_size,
                                        accum=accum)
                batches.seek(step)
                for _ in range(micro + 1):
                    x, _y = batches.next_batch()
                out.append(x)
        return torch.cat(out)

    for order in ("random", "epoch"):
        one = rows(1, 1, order=order)
        assert torch.equal(one, rows(2, 2, order=order)) and torch.equal(one, rows(4, 1, order=order))


def test_the_sharded_draw_equals_the_single_file_draw_of_the_same_tokens(jsonl_gz, tmp_path):
    """The old format's rule, unchanged: offsets keyed by (seed, split, step) over the split's token count."""
    prepare_corpus([jsonl_gz], tmp_path / "out", ByteTokenizer(), workers=1, shard_tokens=111)
    single = tmp_path / "single"
    single.mkdir()
    for split in ("train", "val"):
        expected_split(DOCS, split).astype("<u2").tofile(single / f"{split}.bin")
    meta = {"tokenizer": "bytes", "vocab_size": 257, "train_tokens": len(expected_split(DOCS, "train")),
            "val_tokens": len(expected_split(DOCS, "val"))}
    (single / "meta.json").write_text(json.dumps(meta))
    for step in (0, 7):
        old = TokenBatches(single, "train", block_size=12, batch_size=4, seed=1)
        new = ShardBatches(tmp_path / "out", "train", block_size=12, batch_size=4, seed=1)
        old.seek(step), new.seek(step)
        assert torch.equal(old.global_offsets(step), new.global_offsets(step))
        assert all(torch.equal(a, b) for a, b in zip(old.next_batch(), new.next_batch(), strict=True))


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    prepare_command.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_command_line_prepares_verifies_and_keeps_the_single_file_path(tmp_path):
    (tmp_path / "books").mkdir()
    for i in range(12):
        (tmp_path / "books" / f"{i:02d}.txt").write_text(f"Book {i}.\n" + "To be, or not to be.\n" * 20)
    root = str(tmp_path / "data")
    assert prepare_command.run(parse("text", str(tmp_path / "books"), "--tokenizer", "char", "--workers", "1",
                                     "--shard-tokens", "1000", "--val-fraction", "0.2", "--data-root", root)) == 0
    manifest = json.loads((tmp_path / "data" / "books" / "manifest.json").read_text())
    assert manifest["tokenizer"]["tokenizer"] == "char" and manifest["splits"]["val"]["tokens"] > 0
    assert prepare_command.run(parse("text", "--verify", "--name", "books", "--data-root", root)) == 0
    assert prepare_command.run(parse("shakespeare", "--workers", "2", "--data-root", root)) == 2
    assert prepare_command.run(parse("text", str(tmp_path / "books" / "00.txt"), "--data-root", root)) == 0
    assert sorted(p.name for p in (tmp_path / "data" / "00").iterdir()) == ["meta.json", "train.bin", "val.bin"]
    (tmp_path / "fineweb").mkdir()
    for name in ("fineweb_val_000000.bin", "fineweb_train_000001.bin"):
        write_llmc_shard(tmp_path / "fineweb" / name, np.arange(100))
    assert prepare_command.run(parse("text", str(tmp_path / "fineweb" / "*.bin"), "--data-root", root)) == 1  # no name
    assert prepare_command.run(parse("text", str(tmp_path / "fineweb" / "*.bin"), "--name", "fw", "--data-root",
                                     root)) == 0
    indexed = json.loads((tmp_path / "data" / "fw" / "manifest.json").read_text())
    assert [len(indexed["splits"][s]["shards"]) for s in ("train", "val")] == [1, 1]
    assert indexed["tokenizer"]["eot_id"] == 50256


def test_the_epoch_order_reads_every_document_once_an_epoch_in_a_new_order_each(jsonl_gz, tmp_path):
    prepare_corpus([jsonl_gz], tmp_path / "out", ByteTokenizer(), workers=1, shard_tokens=150)
    docs = [np.array([256, *doc.encode()]) for number, doc in enumerate(DOCS) if not is_val(number, 0.1)]
    batches = EpochBatches(tmp_path / "out", "train", block_size=15, batch_size=4, seed=3)
    assert batches.windows_per_epoch == sum(map(len, docs)) // 16
    orders = []
    for epoch in (0, 1):
        order, _ = batches.epoch_order(epoch)
        assert sorted(order.tolist()) == list(range(len(docs)))
        windows = [epoch * batches.windows_per_epoch + w for w in range(batches.windows_per_epoch)]
        stream = np.concatenate([docs[d] for d in order])
        assert np.array_equal(batches._windows(windows).reshape(-1), stream[:len(windows) * 16])
        orders.append(order.tolist())
    assert orders[0] != orders[1]
    resumed = EpochBatches(tmp_path / "out", "train", block_size=15, batch_size=4, seed=3)
    resumed.seek(9)  # a resumed run reads at iteration 9 what the uninterrupted one does
    batches.seek(0)
    for _ in range(9):
        batches.next_batch()
    assert all(torch.equal(a, b) for a, b in zip(batches.next_batch(), resumed.next_batch(), strict=True))
    with pytest.raises(DataError, match="data.order=epoch"):
        token_batches(tmp_path / "single_file_dataset", "train", order="epoch", block_size=8, batch_size=2)
