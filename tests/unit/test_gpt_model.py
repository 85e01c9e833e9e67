"""GPT model: shapes, counts, init, causality, sampling, training, and HF GPT-2 weight loading."""

import math
import sys

import pytest
import torch

from meshtrain.models.gpt.model import GPT, GPTConfig

TINY = dict(block_size=16, vocab_size=65, n_layer=2, n_head=2, n_embd=32)


def tiny(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**TINY, **kw}))


def analytic_params(V, T, L, C, bias, non_embedding=False):
    """wte (tied to lm_head, counted once) + wpe + L blocks + ln_f."""
    per_block = 12 * C * C + 2 * C  # q/k/v_proj 3C², attn.c_proj C², c_fc 4C², mlp.c_proj 4C²; 2 LN weights
    if bias:
        per_block += 11 * C  # q/k/v_proj 3C + attn.c_proj C + c_fc 4C + mlp.c_proj C + 2 LN biases
    total = V * C + T * C + L * per_block + C + (C if bias else 0)
    return total - T * C if non_embedding else total


def test_shapes_and_initial_loss():
    model = tiny()
    idx, targets = torch.randint(0, 65, (2, 3, 16))
    logits, loss = model(idx, targets)
    assert logits.shape == (3, 16, 65)
    # At init the predictions are near uniform, so the loss is near ln(V). (Targets must not be
    # idx itself: with tied weights the residual stream still holds wte[idx], which favours it.)
    assert abs(loss.item() - math.log(65)) < 0.1
    logits, loss = model(idx)
    assert logits.shape == (3, 1, 65) and loss is None


def test_ignore_index():
    model = tiny()
    idx = torch.randint(0, 65, (2, 16))
    targets = idx.clone()
    targets[:, 8:] = -1
    _, loss = model(idx, targets)
    logits, _ = model(idx, idx)
    expected = torch.nn.functional.cross_entropy(logits[:, :8].reshape(-1, 65), idx[:, :8].reshape(-1))
    torch.testing.assert_close(loss, expected)


def test_weight_tying_and_names():
    model = tiny()
    assert model.lm_head.weight is model.transformer.wte.weight
    names = set(model.state_dict())
    for n in ("transformer.wte.weight", "transformer.wpe.weight", "transformer.h.1.ln_1.weight",
              "transformer.h.1.attn.q_proj.weight", "transformer.h.1.attn.v_proj.bias", "transformer.h.1.attn.c_proj.bias",
              "transformer.h.1.ln_2.bias", "transformer.h.1.mlp.c_fc.weight",
              "transformer.h.1.mlp.c_proj.weight", "transformer.ln_f.weight", "lm_head.weight"):
        assert n in names
    assert not list(model.buffers())  # no causal-mask buffers: SDPA's is_causal does it


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("V,T,L,H,C", [(65, 16, 2, 2, 32), (65, 64, 4, 4, 128), (100, 8, 3, 3, 48)])
def test_param_count_and_flops(V, T, L, H, C, bias):
    model = GPT(GPTConfig(block_size=T, vocab_size=V, n_layer=L, n_head=H, n_embd=C, bias=bias))
    assert model.num_params(non_embedding=False) == analytic_params(V, T, L, C, bias)
    n = analytic_params(V, T, L, C, bias, non_embedding=True)
    assert model.num_params() == n
    assert model.flops_per_token() == 6 * n + 12 * L * H * (C // H) * T
    assert model.flops_per_token(seq_len=T // 2) == 6 * n + 12 * L * H * (C // H) * (T // 2)
    assert model.flops_per_iteration(1000) == 1000 * model.flops_per_token()


def test_gpt2_124m_count_without_building():
    # nanoGPT reports 123.69M (non-embedding) for GPT-2 small with vocab 50304.
    assert analytic_params(50304, 1024, 12, 768, True, non_embedding=True) == 123_689_472


def test_init_statistics():
    torch.manual_seed(0)
    L = 8
    model = GPT(GPTConfig(block_size=16, vocab_size=65, n_layer=L, n_head=4, n_embd=256))
    blk = model.transformer.h["3"]
    for w in (blk.mlp.c_proj.weight, blk.attn.c_proj.weight):  # 262k and 65k samples
        assert w.std().item() == pytest.approx(0.02 / math.sqrt(2 * L), rel=0.03)
        assert abs(w.mean().item()) < 1e-3
    for w in (blk.mlp.c_fc.weight, blk.attn.q_proj.weight, blk.attn.k_proj.weight, model.transformer.wte.weight):
        assert w.std().item() == pytest.approx(0.02, rel=0.03)
    assert torch.all(blk.mlp.c_fc.bias == 0) and torch.all(blk.attn.c_proj.bias == 0)
    assert torch.all(blk.ln_1.weight == 1) and torch.all(blk.ln_1.bias == 0)


def test_meta_device_build_then_init():
    with torch.device("meta"):
        model = GPT(GPTConfig(**TINY))
    model.to_empty(device="cpu")  # this unties lm_head from wte ...
    model.init_weights()  # ... and init_weights ties them again
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.num_params(non_embedding=False) == tiny().num_params(non_embedding=False)
    idx, targets = torch.randint(0, 65, (2, 2, 16))
    _, loss = model(idx, targets)
    assert abs(loss.item() - math.log(65)) < 0.2


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu", "silu"])
def test_causality(activation):
    model = tiny(activation=activation).eval()
    idx = torch.randint(0, 65, (2, 16))
    t = 6
    changed = idx.clone()
    changed[:, t + 1:] = torch.randint(0, 65, (2, 16 - t - 1))
    a, _ = model(idx, idx)
    b, _ = model(changed, changed)
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, t + 1:], b[:, t + 1:])


def test_attention_follows_local_head_count():
    # A tensor-parallel shard holds n_head/tp heads: q/k/v_proj output C/tp each, c_proj takes C/tp.
    # Slicing one head's q, k, v rows and c_proj columns must give that head's contribution.
    model = tiny(bias=False).eval()
    attn = model.transformer.h["0"].attn
    C, D = 32, attn.head_dim
    x = torch.randn(2, 16, C)
    full = attn(x)
    total = torch.zeros_like(full)
    for h in range(2):
        shard = type(attn).__new__(type(attn))
        torch.nn.Module.__init__(shard)
        for name in ("q_proj", "k_proj", "v_proj"):
            proj = torch.nn.Linear(C, D, bias=False)
            proj.weight.data = getattr(attn, name).weight.data[h * D:(h + 1) * D]
            setattr(shard, name, proj)
        shard.c_proj = torch.nn.Linear(D, C, bias=False)
        shard.c_proj.weight.data = attn.c_proj.weight.data[:, h * D:(h + 1) * D]
        shard.resid_dropout, shard.dropout, shard.head_dim, shard.attend = attn.resid_dropout, 0.0, D, attn.attend
        total += shard(x)
    torch.testing.assert_close(total, full, rtol=1e-5, atol=1e-6)


def test_optimizer_groups_partition_params():
    model = tiny()
    decay, no_decay = model.configure_optimizer_groups(0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    ids = [id(p) for g in (decay, no_decay) for p in g["params"]]
    assert len(ids) == len(set(ids))
    assert set(ids) == {id(p) for p in model.parameters()}
    assert all(p.dim() >= 2 for p in decay["params"])
    assert all(p.dim() == 1 for p in no_decay["params"])
    torch.optim.AdamW([decay, no_decay], lr=1e-3)  # the groups are usable as they are


def test_generate_length_and_reproducibility():
    model = tiny().eval()
    prompt = torch.randint(0, 65, (2, 5))

    def sample(seed):
        g = torch.Generator().manual_seed(seed)
        return model.generate(prompt, 20, temperature=0.8, top_k=10, generator=g)

    out = sample(1)
    assert out.shape == (2, 25)  # 25 > block_size 16: the context is cropped while sampling
    assert torch.equal(out[:, :5], prompt)
    assert torch.equal(out, sample(1))
    assert ((out >= 0) & (out < 65)).all()


def test_top_k_1_is_greedy():
    model = tiny().eval()
    prompt = torch.randint(0, 65, (2, 3))
    expected = prompt
    for _ in range(18):
        logits, _ = model(expected[:, -16:])
        expected = torch.cat([expected, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    g = torch.Generator().manual_seed(0)
    assert torch.equal(model.generate(prompt, 18, top_k=1, generator=g), expected)
    assert torch.equal(model.generate(prompt, 18, temperature=0), expected)


def test_crop_block_size():
    model = tiny().eval()
    idx = torch.randint(0, 65, (2, 8))
    before, _ = model(idx, idx)
    model.crop_block_size(8)
    assert model.config.block_size == 8
    assert model.transformer.wpe.weight.shape == (8, 32)
    after, _ = model(idx, idx)
    torch.testing.assert_close(before, after)
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="block_size"):
        model.crop_block_size(9)


def test_config_not_shared():
    cfg = GPTConfig(**TINY)
    GPT(cfg).crop_block_size(4)
    assert cfg.block_size == 16


def test_sequence_longer_than_block_size_raises():
    with pytest.raises(ValueError, match="exceeds block_size 16"):
        tiny()(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize("kw,field", [
    (dict(n_embd=30, n_head=4), "n_embd"),
    (dict(n_layer=0), "n_layer"),
    (dict(n_head=-2), "n_head"),
    (dict(block_size=0), "block_size"),
    (dict(vocab_size=2.5), "vocab_size"),
    (dict(activation="tanh"), "activation"),
    (dict(dropout=1.0), "dropout"),
    (dict(dropout=-0.1), "dropout"),
])
def test_config_validation_names_field(kw, field):
    with pytest.raises(ValueError, match=rf"GPTConfig\.{field}"):
        GPTConfig(**{**TINY, **kw})


def test_training_drives_loss_down():
    model = tiny(dropout=0.1)
    model.train()
    torch.manual_seed(1)
    seq = torch.randint(0, 65, (17,))
    x, y = seq[:-1].repeat(4, 1), seq[1:].repeat(4, 1)
    opt = torch.optim.AdamW(model.configure_optimizer_groups(0.1), lr=3e-3)
    losses = []
    for _ in range(40):
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > 4.0
    assert losses[-1] < 1.0, losses[::5]


# ---------------------------------------------------------------- Hugging Face GPT-2 weights


def _save_tiny_hf(path, **kw):
    transformers = pytest.importorskip("transformers", reason="transformers not installed (pip install 'meshtrain[hf]')")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=16, vocab_size=65,
                                  bos_token_id=0, eos_token_id=0, **kw)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    hf.save_pretrained(str(path))
    return hf


def test_from_pretrained_matches_hf_logits(tmp_path):
    hf = _save_tiny_hf(tmp_path)
    model = GPT.from_pretrained(str(tmp_path)).eval()
    assert model.config == GPTConfig(block_size=16, vocab_size=65, n_layer=2, n_head=2, n_embd=32,
                                     bias=True, activation="gelu_tanh", dropout=0.0)
    assert model.lm_head.weight is model.transformer.wte.weight
    idx = torch.randint(0, 65, (3, 16))
    with torch.no_grad():
        ours, _ = model(idx, idx)
        theirs = hf(idx).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_from_pretrained_overrides(tmp_path):
    _save_tiny_hf(tmp_path)
    assert GPT.from_pretrained(str(tmp_path), {"dropout": 0.2}).config.dropout == 0.2
    with pytest.raises(ValueError, match="only override 'dropout'"):
        GPT.from_pretrained(str(tmp_path), {"n_layer": 3})


def test_from_pretrained_refuses_unsupported_variant(tmp_path):
    _save_tiny_hf(tmp_path, n_inner=64)
    with pytest.raises(ValueError, match="n_inner=64"):
        GPT.from_pretrained(str(tmp_path))


def test_from_pretrained_without_transformers(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(ImportError, match=r"meshtrain\[hf\]"):
        GPT.from_pretrained("gpt2")
