"""data/tokenizers.py: every tokenizer kind behind one interface, loaded by spec, offline, fingerprinted."""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import socket

import numpy as np
import pytest

from meshtrain.commands import prepare as prepare_command
from meshtrain.data import tokenizers
from meshtrain.data.text import load_meta, shakespeare_text
from meshtrain.data.tokenizers import (
    CharTokenizer,
    DataError,
    GPT2Tokenizer,
    HFTokenizer,
    TiktokenTokenizer,
    load_tokenizer,
    tokenizer_from_meta,
    train_bpe,
)

SAMPLE = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak. 42 cafés ☃\n"
CL100K_URL = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"
CL100K_CACHE_NAME = "9b5ad71b2ce5302211f9c61530b329a4922fc6a4"  # sha1 of the URL: tiktoken's cache file name


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    prepare_command.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The first 60,000 characters of the shipped Shakespeare, as a file: a BPE trains on it in ~0.1 s."""
    path = tmp_path_factory.mktemp("corpus") / "shakespeare_slice.txt"
    path.write_text(shakespeare_text()[:60_000], encoding="utf-8")
    return path


def test_gpt2_by_spec():
    tok = load_tokenizer("gpt2")
    assert isinstance(tok, GPT2Tokenizer) and (tok.kind, tok.spec) == ("gpt2", "gpt2")
    assert tok.encode("hello world") == [31373, 995]
    assert tok.encode_batch(["hello world", " world"]) == [[31373, 995], [995]]
    assert (tok.vocab_size, tok.eot_id) == (50257, 50256)
    assert tok.encode("<|endoftext|>") != [50256]  # the special token's text in a document is plain text
    assert tok.meta() == {"tokenizer": "gpt2", "vocab_size": 50257, "spec": "gpt2", "fingerprint": tok.fingerprint,
                          "eot_id": 50256}
    assert len(tok.fingerprint) == 64


def test_gpt2_ranks_rewritten_to_a_file_are_the_gpt2_encoding(tmp_path):
    path = tmp_path / "r50k_base.tiktoken"
    path.write_bytes(tokenizers._gpt2_ranks_bytes())  # no sidecar: known by its sha256
    tok, gpt2 = load_tokenizer(str(path)), load_tokenizer("gpt2")
    assert isinstance(tok, TiktokenTokenizer) and tok.kind == "tiktoken" and tok.spec == str(path.resolve())
    assert tok.encode("hello world") == [31373, 995]
    assert tok.encode(SAMPLE) == gpt2.encode(SAMPLE) and tok.decode(tok.encode(SAMPLE)) == SAMPLE
    assert (tok.vocab_size, tok.eot_id, tok.fingerprint) == (50257, 50256, gpt2.fingerprint)


def write_tiny_ranks(path):
    """A hand-made ranks file: the 256 bytes, then the merges "ab" (256) and "abab" (257)."""
    ranks = {bytes([b]): b for b in range(256)} | {b"ab": 256, b"abab": 257}
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % r for t, r in ranks.items()))


def test_a_hand_made_ranks_file_takes_its_pattern_and_specials_from_its_sidecar(tmp_path):
    path = tmp_path / "tiny.tiktoken"
    write_tiny_ranks(path)
    with pytest.raises(DataError, match=r"258 tokens that meshtrain does not know: write .* to .*tiny\.tiktoken\.json"):
        load_tokenizer(str(path))
    sidecar = tmp_path / "tiny.tiktoken.json"
    sidecar.write_text(json.dumps({"pattern": r"\S+|\s+", "special_tokens": {"<|eot|>": 258}, "eot": "<|eot|>"}))
    tok = load_tokenizer(str(path))
    assert tok.encode("abab ab b") == [257, 32, 256, 32, 98]
    assert tok.decode([257, 32, 256]) == "abab ab"
    assert (tok.vocab_size, tok.eot_id) == (259, 258)
    first = tok.fingerprint
    sidecar.write_text(json.dumps({"pattern": r"\S+|\s+", "special_tokens": {"<|eot|>": 300}}))
    assert load_tokenizer(str(path)).fingerprint != first  # the specials define the encoding too
    sidecar.write_text("{not json")
    with pytest.raises(DataError, match=r"tiny\.tiktoken\.json should be JSON"):
        load_tokenizer(str(path))


def test_a_tokenizer_json_trained_on_shakespeare_round_trips(tmp_path, corpus):
    tok = train_bpe([corpus], 300, tmp_path / "bpe300.json")
    assert isinstance(tok, HFTokenizer) and (tok.kind, tok.vocab_size, tok.eot_id) == ("huggingface", 300, 0)
    ids = tok.encode(SAMPLE)
    assert tok.decode(ids) == SAMPLE and max(ids) < 300 and len(ids) < len(SAMPLE.encode())  # merges were learnt
    assert tok.encode_batch([SAMPLE, "hear me"]) == [ids, tok.encode("hear me")]
    assert 0 not in tok.encode("<|endoftext|>")  # its text in a document is plain text, as tiktoken's ordinary
    again = load_tokenizer(str(tmp_path / "bpe300.json"))
    assert again.fingerprint == tok.fingerprint and again.encode(SAMPLE) == ids
    other = train_bpe([corpus], 320, tmp_path / "bpe320.json")
    assert other.fingerprint != tok.fingerprint and other.vocab_size == 320


def test_a_named_tiktoken_encoding_missing_from_the_cache_is_one_clear_error(tmp_path, monkeypatch):
    cache = tmp_path / "tiktoken_cache"
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    connections = []

    def no_network(self, address):
        connections.append(address)
        raise AssertionError(f"a connection to {address} was attempted")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    with pytest.raises(DataError) as error:
        load_tokenizer("cl100k_base")
    message = str(error.value)
    assert f"put that file at {cache / CL100K_CACHE_NAME}" in message and CL100K_URL in message
    assert "never downloads at run time" in message
    assert connections == [] and not cache.exists()


def test_a_named_tiktoken_encoding_in_the_cache_loads_offline(tmp_path, monkeypatch):
    # r50k_base's file is GPT-2's ranks, which ship with meshtrain: put them where tiktoken's cache holds them.
    cache = tmp_path / "tiktoken_cache"
    cache.mkdir()
    url = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"
    (cache / hashlib.sha1(url.encode()).hexdigest()).write_bytes(tokenizers._gpt2_ranks_bytes())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    monkeypatch.setattr(socket.socket, "connect", lambda self, address: pytest.fail(f"connected to {address}"))
    tok = load_tokenizer("r50k_base")
    assert (tok.kind, tok.spec, tok.vocab_size, tok.eot_id) == ("tiktoken", "r50k_base", 50257, 50256)
    assert tok.encode("hello world") == [31373, 995] and tok.encode(SAMPLE) == load_tokenizer("gpt2").encode(SAMPLE)
    assert tokenizer_from_meta(tok.meta()).fingerprint == tok.fingerprint


def test_prepare_tokenizer_writes_a_spec_that_prepare_text_uses(tmp_path, corpus):
    out = tmp_path / "tok" / "shakespeare_bpe.json"
    assert prepare_command.run(parse("tokenizer", str(corpus), "--vocab-size", "280", "--out", str(out))) == 0
    tok = load_tokenizer(str(out))
    assert (tok.kind, tok.vocab_size, tok.spec) == ("huggingface", 280, str(out.resolve()))
    assert prepare_command.run(parse("tokenizer", str(corpus), "--out", str(out))) == 2  # no --vocab-size
    assert prepare_command.run(parse("text", str(corpus), "--vocab-size", "280")) == 2

    root = tmp_path / "root"
    assert prepare_command.run(parse("text", str(corpus), "--tokenizer", str(out), "--data-root", str(root))) == 0
    meta = load_meta(root / corpus.stem)
    assert (meta["tokenizer"], meta["vocab_size"], meta["spec"]) == ("huggingface", 280, str(out.resolve()))
    assert (meta["fingerprint"], meta["eot_id"]) == (tok.fingerprint, 0)
    again = tokenizer_from_meta(meta)
    splits = [np.fromfile(root / corpus.stem / f"{s}.bin", dtype=np.uint16) for s in ("train", "val")]
    assert again.decode(splits[0]) + again.decode(splits[1]) == corpus.read_text(encoding="utf-8")

    train_bpe([corpus], 290, out)  # another tokenizer at the same path: the dataset's ids no longer mean its words
    with pytest.raises(DataError, match=r"shakespeare_bpe\.json is not the one this dataset was prepared with"):
        tokenizer_from_meta(meta)


def test_meta_json_from_before_specs_loads_unchanged():
    char = tokenizer_from_meta({"tokenizer": "char", "vocab_size": 3, "stoi": {"a": 0, "b": 1, "c": 2},
                                "itos": ["a", "b", "c"], "train_tokens": 9, "val_tokens": 1})
    assert isinstance(char, CharTokenizer) and char.encode("cab") == [2, 0, 1] and char.vocab_size == 3
    assert char.meta()["spec"] == "char" and char.eot_id is None
    gpt2 = tokenizer_from_meta({"tokenizer": "gpt2", "vocab_size": 50257, "train_tokens": 9, "val_tokens": 1})
    assert isinstance(gpt2, GPT2Tokenizer) and gpt2.encode("hello world") == [31373, 995]


def test_char_is_fitted_from_a_text():
    tok = load_tokenizer("char", text="hello")
    assert tok.itos == ["e", "h", "l", "o"] and tok.encode("hole") == [1, 3, 2, 0]
    assert tok.fingerprint == CharTokenizer(["e", "h", "l", "o"]).fingerprint != CharTokenizer(["a"]).fingerprint
    with pytest.raises(DataError, match="fitted from a text"):
        load_tokenizer("char")


def test_an_unknown_spec_names_the_choices(tmp_path):
    with pytest.raises(DataError, match=r"unknown tokenizer 'llama3': choose char, gpt2, a tiktoken encoding .*"
                                        r"cl100k_base.*tokenizer\.json.*tiktoken ranks file"):
        load_tokenizer("llama3")
    with pytest.raises(DataError, match=r"tokenizer file .*absent\.json not found"):
        load_tokenizer(str(tmp_path / "absent.json"))


def test_the_model_vocabulary_is_the_tokenizers(monkeypatch):
    from meshtrain.config import ConfigError, load_config
    from meshtrain.models.gpt import build_model
    from meshtrain.models.gpt.model import GPT, GPTConfig

    tiny = ["preset=cpu", "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=16"]
    meta = {"tokenizer": "huggingface", "vocab_size": 281}
    assert build_model(load_config(tiny, "gpt"), {"meta": meta}).lm_head.out_features == 281
    # Pretrained weights bring their own embedding rows: a tokenizer with more ids is refused before training.
    monkeypatch.setattr(GPT, "from_pretrained", classmethod(
        lambda cls, name, override_args=None: cls(GPTConfig(block_size=16, vocab_size=256, n_layer=1, n_head=2,
                                                            n_embd=32))))
    pretrained = load_config([*tiny, "train.init_from=/weights/of/gpt2"], "gpt")
    with pytest.raises(ConfigError, match=r"init_from=/weights/of/gpt2 has 256 token embeddings, but the data's "
                                          r"huggingface tokenizer has 281 ids"):
        build_model(pretrained, {"meta": meta})
    assert build_model(pretrained, {"meta": {**meta, "vocab_size": 200}}).lm_head.out_features == 256


def wide_ranks_file(folder) -> tuple:
    """A tiktoken ranks file of 70,000 tokens with its sidecar: the 256 bytes, unreachable fillers, then the pairs of
    lowercase letters and spaces at ranks past 65,536, so that ordinary English encodes to ids uint16 cannot hold."""
    letters = [bytes([c]) for c in b"abcdefghijklmnopqrstuvwxyz "]
    pairs = [a + b for a in letters for b in letters]
    fillers = [b"\x00" + i.to_bytes(3, "big") for i in range(70_000 - 256 - len(pairs))]  # no merge builds one
    tokens = [bytes([b]) for b in range(256)] + fillers + pairs
    path = folder / "wide.tiktoken"
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % rank for rank, t in enumerate(tokens)))
    (folder / "wide.tiktoken.json").write_text(json.dumps(
        {"pattern": tokenizers.GPT2_PATTERN, "special_tokens": {"<|endoftext|>": 70_000}}))
    return path, len(tokens) - len(pairs)


def test_prepare_text_past_65536_ids_writes_uint32_shards_and_the_models_vocabulary_follows(tmp_path, corpus):
    from meshtrain.config import load_config
    from meshtrain.data.shards import ShardBatches, read_header
    from meshtrain.data.streams import dataset_meta
    from meshtrain.models.gpt import build_model as build_gpt
    from meshtrain.models.language.workload import text_data_facts
    from meshtrain.models.llama import build_model as build_llama

    ranks, first_pair = wide_ranks_file(tmp_path)
    root, args = tmp_path / "data", ("--name", "wide", "--data-root", str(tmp_path / "data"))
    assert prepare_command.run(parse("text", str(corpus), "--tokenizer", str(ranks), *args)) == 0
    data_dir = root / "wide"
    assert not (data_dir / "train.bin").exists() and (data_dir / "manifest.json").is_file()
    assert read_header(data_dir / "train_000000.bin").dtype == np.dtype("<u4")
    meta = dataset_meta(data_dir)
    assert (meta["tokenizer"], meta["vocab_size"], meta["eot_id"]) == ("tiktoken", 70_001, 70_000)
    tok = tokenizer_from_meta(meta)
    x, _ = ShardBatches(data_dir, "val", block_size=64, batch_size=2, seed=0).next_batch()
    assert int(x.max()) >= first_pair > 1 << 16 and tok.decode(x[0].tolist()) in shakespeare_text()[:60_000]
    # The same again is up to date; the model's vocabulary is the tokenizer's (GPT and Llama: the data's meta).
    assert prepare_command.run(parse("text", str(corpus), "--tokenizer", str(ranks), *args)) == 0
    overrides = [f"data.root={root}", "data.name=wide", "model.n_layer=1", "model.n_embd=32", "model.n_head=2",
                 "model.block_size=16"]
    for family, build in (("gpt", build_gpt), ("llama", build_llama)):
        cfg = load_config(["preset=cpu", *overrides, *(["model.n_kv_head=2"] if family == "llama" else [])], family)
        assert build(cfg, text_data_facts(cfg)).lm_head.out_features == 70_001


def test_a_run_carries_its_tokenizer_files_and_loads_them_after_the_originals_are_gone(tmp_path, corpus):
    """A run's meta (in each checkpoint and in model.pt) carries the text of a file-based tokenizer's files: with
    the tokenizer.json, or a ranks file and its sidecar, moved or rewritten, the run still decodes as it trained;
    a carried file that is not the one it trained with is refused."""
    bpe = train_bpe([corpus], 300, tmp_path / "bpe300.json")
    wide_path, _ = wide_ranks_file(tmp_path)
    wide = load_tokenizer(str(wide_path))
    assert list(wide.files()) == ["wide.tiktoken", "wide.tiktoken.json"] and load_tokenizer("gpt2").files() == {}
    carried = {tok.spec: {**tok.meta(), "tokenizer_files": tok.files()} for tok in (bpe, wide)}
    ids = {spec: tokenizer_from_meta(meta).encode(SAMPLE) for spec, meta in carried.items()}
    train_bpe([corpus], 290, tmp_path / "bpe300.json")  # another tokenizer at the run's path
    for path in (wide_path, wide_path.with_name("wide.tiktoken.json")):
        path.rename(path.with_suffix(".moved"))
    for spec, meta in carried.items():
        with pytest.raises(DataError):  # the originals no longer give the run's ids
            tokenizer_from_meta({k: v for k, v in meta.items() if k != "tokenizer_files"})
        again = tokenizer_from_meta(meta)
        assert again.spec == spec and again.fingerprint == meta["fingerprint"]
        assert again.encode(SAMPLE) == ids[spec] and again.decode(ids[spec]) == SAMPLE
    tampered = {**carried[bpe.spec], "tokenizer_files": {"bpe300.json": (tmp_path / "bpe300.json").read_text()}}
    with pytest.raises(DataError, match="not the ones it was trained with"):
        tokenizer_from_meta(tampered)
