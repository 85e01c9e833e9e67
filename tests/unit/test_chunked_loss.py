"""train.loss_chunk_tokens: the output layer and loss a few tokens at a time (nn/chunked_loss.py) give the loss and
the gradients of the whole-logits cross-entropy, in a model too (the tied embedding's two gradients added), and the
layouts it cannot serve are refused naming the fix."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from meshtrain import config as config_mod
from meshtrain.nn.chunked_loss import chunked_cross_entropy


def test_chunks_give_the_whole_losss_value_and_gradients_to_float64_rounding():
    torch.manual_seed(0)
    hidden = torch.randn(2, 37, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (2, 37))
    targets[0, 3], targets[1, :5] = -1, -1  # ignored, as cross_entropy's ignore_index=-1
    whole = F.cross_entropy((hidden @ weight.t()).reshape(-1, 50), targets.reshape(-1), ignore_index=-1)
    want = torch.autograd.grad(3 * whole, (hidden, weight))
    for chunk in (1, 10, 37, 74, 500):  # one token, uneven chunks, one sequence, exactly all, more than all
        loss = chunked_cross_entropy(hidden, weight, targets, chunk)
        got = torch.autograd.grad(3 * loss, (hidden, weight))
        assert loss.item() == pytest.approx(whole.item(), rel=1e-14, abs=0), chunk
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-15)


def test_under_bf16_autocast_the_chunks_follow_the_whole_loss():
    torch.manual_seed(0)
    hidden = torch.randn(64, 32, requires_grad=True)
    weight = torch.randn(100, 32, requires_grad=True)
    targets = torch.randint(0, 100, (64,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        whole = F.cross_entropy(F.linear(hidden, weight).float(), targets)
        loss = chunked_cross_entropy(hidden, weight, targets, 16)
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(whole.item(), rel=1e-5)
    for got, want in zip(torch.autograd.grad(loss, (hidden, weight)), torch.autograd.grad(whole, (hidden, weight)),
                         strict=True):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=0.02, atol=0.02 * want.abs().max().item())


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_a_decoder_with_a_chunked_loss_trains_as_with_the_whole(model):
    """The same model and batch: the loss, and every parameter's gradient (the tied embedding's too), equal."""
    build_model = importlib.import_module(f"meshtrain.models.{model}").build_model
    overrides = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=16"] + (
        ["model.n_kv_head=1"] if model == "llama" else [])
    grads = []
    for chunk in ("null", "24"):
        torch.manual_seed(0)
        cfg = config_mod.load_config([*overrides, f"train.loss_chunk_tokens={chunk}"], model)
        net = build_model(cfg, {"meta": {"vocab_size": 65}}).double()
        idx = torch.randint(0, 65, (3, 16), generator=torch.Generator().manual_seed(1))
        logits, loss = net(idx, idx.roll(-1, 1))
        assert (logits is None) == (chunk != "null")  # no [tokens, vocabulary] logits made
        loss.backward()
        grads.append((loss.item(), {n: p.grad for n, p in net.named_parameters()}))
    (whole, want), (chunked, got) = grads
    assert chunked == pytest.approx(whole, rel=1e-13)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-13, msg=name)


@pytest.mark.parametrize("layout, said", [("parallel.tp=2", "parallel.tp=2: loss parallel already keeps"),
                                          ("parallel.pp=2", "parallel.pp=2: a pipeline's last stage")])
def test_a_chunked_loss_where_the_layout_computes_its_own_is_refused_naming_the_fix(layout, said):
    with pytest.raises(config_mod.ConfigError, match=f"train.loss_chunk_tokens=64 with {said}.*"
                                                     "set train.loss_chunk_tokens=null"):
        config_mod.load_config(["train.loss_chunk_tokens=64", layout], "gpt")
    with pytest.raises(config_mod.ConfigError, match="train.loss_chunk_tokens=0: must be at least 1"):
        config_mod.load_config(["train.loss_chunk_tokens=0"], "gpt")
