"""train.loss_chunks: the output layer and loss a few tokens at a time (nn/chunked_loss.py) give the loss and the
gradients of the whole-logits cross-entropy (float64: to rounding; fp32: within 1e-6 relative, which is what lets
`auto` be the default), in a model too (the tied embedding's two gradients added); what auto chooses; the key's
values and its old name. Under tp and pp: tests/distributed/layout_check.py's loss_chunks cases. And the whole
loss compiled beside the blocks (compile_loss), as eager, where compose turns it on."""

from __future__ import annotations

import functools
import importlib
import threading

import pytest
import torch
import torch.nn.functional as F

from meshtrain import config as config_mod
from meshtrain.models.language import AUTO_CHUNK_LOGITS, AUTO_VOCAB, resolve_loss_chunks, with_loss_chunks
from meshtrain.nn import chunked_loss
from meshtrain.nn.chunked_loss import chunked_cross_entropy
from meshtrain.parallel.compose import compile_loss
from meshtrain.parallel.mesh import ParallelDims

# On CUDA the chunks' matmuls pad the output layer's rows to a multiple of 64 (aligned for cuBLAS): here padded
# on the CPU too, the padding must change nothing.
PADDED = pytest.mark.parametrize("words_multiple", [1, 64], ids=["as-is", "padded-as-on-cuda"])


@PADDED
def test_chunks_give_the_whole_losss_value_and_gradients_to_float64_rounding(words_multiple, monkeypatch):
    monkeypatch.setattr(chunked_loss, "_words_multiple", lambda device: words_multiple)
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
    with torch.no_grad():  # evaluation: no gradients made
        assert chunked_cross_entropy(hidden, weight, targets, 10).item() == pytest.approx(whole.item(), rel=1e-14)
    summed = chunked_cross_entropy(hidden, weight, targets, 10, reduction="sum")  # a pipeline microbatch's
    assert summed.item() == pytest.approx(whole.item() * (targets != -1).sum().item(), rel=1e-14)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def test_in_fp32_the_chunks_stay_within_1e_6_of_the_whole_loss_and_its_gradients():
    """GPT-2-like proportions in fp32 (what train.loss_chunks=auto changes by default): every chunk size, one that
    does not divide the 2 × 300 tokens among them, with ignored targets, within 1e-6 relative. (Below 16 tokens a chunk
    this CPU's small-matrix kernels round the hidden states' gradient differently: 5e-6 from float64's, the whole
    loss's 7e-7; auto never chunks so finely, and the float64 test above covers one token a chunk.)"""
    torch.manual_seed(0)
    hidden = torch.randn(2, 300, 64, requires_grad=True)
    weight = (0.02 * torch.randn(9000, 64)).requires_grad_()
    targets = torch.randint(0, 9000, (2, 300))
    targets[0, :17], targets[1, 250:] = -1, -1
    whole = F.cross_entropy(F.linear(hidden, weight).reshape(-1, 9000), targets.reshape(-1), ignore_index=-1)
    want = torch.autograd.grad(whole, (hidden, weight))
    worst = 0.0
    for chunk in (16, 64, 128, 333, 600):
        loss = chunked_cross_entropy(hidden, weight, targets, chunk)
        got = torch.autograd.grad(loss, (hidden, weight))
        worst = max(worst, abs(loss.item() - whole.item()) / whole.item(), *map(_relative, got, want))
    assert worst <= 1e-6, worst


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
    for chunk in ("off", "24"):
        torch.manual_seed(0)
        cfg = config_mod.load_config([*overrides, f"train.loss_chunks={chunk}"], model)
        net = build_model(cfg, {"meta": {"vocab_size": 65}}).double()
        idx = torch.randint(0, 65, (3, 16), generator=torch.Generator().manual_seed(1))
        logits, loss = net(idx, idx.roll(-1, 1))
        assert (logits is None) == (chunk != "off")  # no [tokens, vocabulary] logits made
        loss.backward()
        grads.append((loss.item(), {n: p.grad for n, p in net.named_parameters()}))
    (whole, want), (chunked, got) = grads
    assert chunked == pytest.approx(whole, rel=1e-13)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-13, msg=name)


@pytest.mark.parametrize("chunks", ["off", "24"])
def test_the_compiled_output_layer_and_loss_train_as_eager(chunks, monkeypatch):
    """compile_loss (train.compile=blocks on a GPU, parallel/compose.py): the whole-logits output layer and loss as
    one graph, or each chunk's softmax and gradient as one (24 tokens a chunk: two of 24 and none of 48 tokens, two
    shapes), with the same loss and gradients as eager (fp32, 1e-6 relative). Traced here by dynamo and AOT autograd
    (backend aot_eager): on a CPU inductor's kernels risk torch's bug, which is why compose compiles the loss on a
    GPU only; tests/gpu runs inductor's."""
    compiled = []

    def compiled_function(function):
        compiled.append(function.__name__)
        return torch.compile(function, backend="aot_eager", dynamic=False)

    monkeypatch.setattr(chunked_loss, "compiled_function", functools.cache(compiled_function))
    build_model = importlib.import_module("meshtrain.models.gpt").build_model
    cfg = config_mod.load_config(["model.n_layer=1", "model.n_head=2", "model.n_embd=32", "model.block_size=16",
                                  f"train.loss_chunks={chunks}"], "gpt")
    torch.manual_seed(0)
    net = build_model(cfg, {"meta": {"vocab_size": 65}})
    idx = torch.randint(0, 65, (3, 16), generator=torch.Generator().manual_seed(1))
    runs = []
    for compiled_loss in (False, True):
        net.compile_loss = compiled_loss
        net.zero_grad()
        _, loss = net(idx, idx.roll(-1, 1))
        loss.backward()
        runs.append((loss.item(), {n: p.grad.clone() for n, p in net.named_parameters()}))
    assert compiled == (["logits_and_loss"] if chunks == "off" else ["_chunk_gradient"])
    (eager, want), (graphs, got) = runs
    assert graphs == pytest.approx(eager, rel=1e-6)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-6 * want[name].abs().max().item(),
                                   msg=name)


def test_compose_compiles_a_decoders_loss_on_a_gpu_with_the_vocabulary_whole():
    """On a CPU torch's inductor bug (pytorch/pytorch#196681) rules it out; under tp the head is a DTensor whose loss
    is DTensor's loss parallel; a pipeline's schedule computes its last stage's loss; chunks are compiled too."""
    build_model = importlib.import_module("meshtrain.models.gpt").build_model
    net = build_model(config_mod.load_config(["model.n_layer=1", "model.n_embd=16", "model.n_head=2"], "gpt"),
                      {"meta": {"vocab_size": 65}})
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    layouts = [(ParallelDims(), cuda), (ParallelDims.resolve(2, tp=2), cuda), (ParallelDims.resolve(2, pp=2), cuda),
               (ParallelDims(), cpu)]
    assert [compile_loss(net, dims, device) for dims, device in layouts] == [True, False, False, False]
    assert not net.compile_loss
    net.config.loss_chunks = 64  # each chunk's graph
    assert compile_loss(net, ParallelDims(), cuda) is True
    assert compile_loss(torch.nn.Linear(2, 2), ParallelDims(), cuda) is False  # not a decoder


def test_auto_chunks_big_vocabularies_only_and_is_the_default():
    assert config_mod.load_config([], "gpt").train.loss_chunks == "auto"
    assert resolve_loss_chunks("auto", 65) is None and resolve_loss_chunks("auto", AUTO_VOCAB) is None  # characters
    assert resolve_loss_chunks("auto", 50304) == 320  # GPT-2: 320 × 50,304 fp32 logits, 61 MiB
    assert resolve_loss_chunks("auto", 128256) == 128 and resolve_loss_chunks("auto", 10**7) == 64  # at least 64
    for device, budget in AUTO_CHUNK_LOGITS.items():
        assert all(resolve_loss_chunks("auto", v, device) * 4 * v <= budget for v in (8193, 32000, 50304, 128256))
    assert resolve_loss_chunks("auto", 50304, "cuda") == 1280  # a GPU's: 1,280 × 50,304 fp32 logits, 246 MiB
    assert resolve_loss_chunks("auto", 128256, "cuda") == 512 and resolve_loss_chunks("auto", 65, "cuda") is None
    assert resolve_loss_chunks("off", 50304) is None and resolve_loss_chunks("100", 65) == 100
    assert resolve_loss_chunks("100", 50304, "cuda") == 100  # a number is the number on any device
    # what a run's config (and the plan's trace) says: auto made a number, or off, for the device
    cfg = config_mod.load_config([], "gpt")
    assert with_loss_chunks(cfg, 50304, "cuda").train.loss_chunks == "1280"
    assert with_loss_chunks(cfg, 50304, "cpu").train.loss_chunks == "320"
    assert with_loss_chunks(cfg, 65, "cuda").train.loss_chunks == "off"
    given = config_mod.load_config(["train.loss_chunks=64"], "gpt")
    assert with_loss_chunks(given, 50304, "cuda") is given
    build_model = importlib.import_module("meshtrain.models.gpt").build_model
    small = ["model.n_layer=1", "model.n_head=2", "model.n_embd=16", "model.block_size=8"]
    net = build_model(config_mod.load_config(small, "gpt"), {"meta": {"vocab_size": 50304}})
    assert net.config.loss_chunks == 320


@pytest.mark.parametrize("layout", ["parallel.tp=2", "parallel.pp=2", "parallel.tp=2 parallel.loss_parallel=false"])
def test_chunks_are_taken_with_tensor_and_pipeline_parallelism(layout):
    assert config_mod.load_config(["train.loss_chunks=64", *layout.split()], "gpt").train.loss_chunks == "64"


def test_the_values_and_the_old_name_are_refused_naming_the_key():
    for bad in ("0", "-3", "some", "1.5"):
        with pytest.raises(config_mod.ConfigError, match=f"train.loss_chunks={bad}: must be auto, off or a number"):
            config_mod.load_config([f"train.loss_chunks={bad}"], "gpt")
    assert config_mod.load_config(["train.loss_chunks=OFF"], "gpt").train.loss_chunks == "off"
    with pytest.raises(config_mod.ConfigError, match="unknown key 'train.loss_chunk_tokens': did you mean "
                                                     "train.loss_chunks"):
        config_mod.load_config(["train.loss_chunk_tokens=64"], "gpt")


@PADDED
def test_vocabulary_slices_put_together_give_the_whole_loss(words_multiple, monkeypatch):
    """Under tp each rank holds a slice of the vocabulary (65 over 3: 22 + 22 + 21, as DTensor's Shard(0)); its
    chunks' softmax is summed over the slices by all-reduces. Three threads stand in for the ranks here, an
    all-reduce for each call; the multi-process DTensor path is layout_check.py's loss_chunks cases."""
    ranks, vocab = 3, 65
    torch.manual_seed(0)
    hidden, weight = torch.randn(2, 37, 16, dtype=torch.float64), torch.randn(vocab, 16, dtype=torch.float64)
    targets = torch.randint(0, vocab, (2, 37))
    targets[1, :5] = -1
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    whole = F.cross_entropy((h @ w.t()).reshape(-1, vocab), targets.reshape(-1), ignore_index=-1)
    want = torch.autograd.grad(whole, (h, w))
    barrier, slots, me = threading.Barrier(ranks), [None] * ranks, threading.local()

    def all_reduce(tensor, group, op=chunked_loss.dist.ReduceOp.SUM):
        slots[me.rank] = tensor.clone()
        barrier.wait()
        stacked = torch.stack(slots)
        reduced = stacked.amax(0) if op == chunked_loss.dist.ReduceOp.MAX else stacked.sum(0)
        barrier.wait()
        return tensor.copy_(reduced)

    monkeypatch.setattr(chunked_loss, "_all_reduce", all_reduce)
    monkeypatch.setattr(chunked_loss, "_words_multiple", lambda device: words_multiple)
    got = {}

    def rank(r: int) -> None:
        me.rank, first = r, r * -(-vocab // ranks)
        h, w = hidden.clone().requires_grad_(), weight[first:first + -(-vocab // ranks)].clone().requires_grad_()
        loss = chunked_loss._ChunkedCrossEntropy.apply(h, w, targets, 10, False, "tp", first,
                                                       chunked_loss._chunk_gradient)
        got[r] = (loss, *torch.autograd.grad(loss, (h, w)), first)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(got) == list(range(ranks))  # every rank finished (a thread's exception only warns)
    for loss, grad_hidden, grad_slice, first in got.values():
        assert loss.item() == pytest.approx(whole.item(), rel=1e-14)
        torch.testing.assert_close(grad_hidden, want[0], rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(grad_slice, want[1][first:first + len(grad_slice)], rtol=1e-12, atol=1e-15)
