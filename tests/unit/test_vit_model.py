"""ViT weather model: shapes, patch layout, counts, flops, losses, training, metrics, and the parallelism seams."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from meshtrain.config import load_config
from meshtrain.models.vit.metrics import latitude_weighted_rmse, rmse
from meshtrain.models.vit.model import ViT, ViTConfig, relative_l2_loss

# 4 x 8 = 32 tokens: small enough for CPU training in a test.
SMALL = dict(img_size=(16, 32), patch_size=4, in_channels=3, out_channels=3, embed_dim=32, depth=2, num_heads=4)


def preset(name: str) -> dict:
    """ViTConfig fields of the model in configs/vit/NAME.yaml (the presets' one source) on its crop of ERA5's 20
    channels."""
    cfg = load_config([f"preset={name}"], "vit")
    m = cfg.model
    return dict(img_size=tuple(cfg.data.crop), patch_size=m.patch_size, embed_dim=m.embed_dim, depth=m.depth,
                num_heads=m.num_heads)


def small(**kw) -> ViT:
    torch.manual_seed(0)
    return ViT(ViTConfig(**{**SMALL, **kw}))


def analytic_params(cfg: ViTConfig) -> int:
    D, p2, hid, b = cfg.embed_dim, cfg.patch_size ** 2, cfg.mlp_hidden, int(cfg.bias)
    patch_embed = cfg.in_channels * p2 * D + b * D
    pos_embed = cfg.num_patches * D
    attn = 4 * D * D + b * 4 * D  # q, k, v, c_proj
    mlp = 2 * D * hid + b * (hid + D)
    norms = 2 * D + b * 2 * D
    final_norm = D + b * D
    head = D * cfg.out_channels * p2  # no bias, as NERSC
    return patch_embed + pos_embed + cfg.depth * (attn + mlp + norms) + final_norm + head


def analytic_matmul_params(cfg: ViTConfig) -> int:
    D, p2 = cfg.embed_dim, cfg.patch_size ** 2
    return cfg.in_channels * p2 * D + cfg.depth * (4 * D * D + 2 * D * cfg.mlp_hidden) + D * cfg.out_channels * p2


@pytest.mark.parametrize("kw,shape_in,shape_out", [
    (preset("tiny"), (2, 20, 80, 160), (2, 20, 80, 160)),
    (dict(SMALL, in_channels=3, out_channels=5, mlp_ratio=2.0, bias=False), (3, 3, 16, 32), (3, 5, 16, 32)),
    (dict(SMALL, img_size=(24, 8), patch_size=8, num_heads=2), (1, 3, 24, 8), (1, 3, 24, 8)),
])
def test_output_shape(kw, shape_in, shape_out):
    torch.manual_seed(0)
    model = ViT(ViTConfig(**kw))
    y = model(torch.randn(shape_in))
    assert y.shape == shape_out and y.dtype == torch.float32 and torch.isfinite(y).all()


def test_patchify_round_trip_and_conv_layout():
    model = small(in_channels=3, out_channels=3, embed_dim=48, num_heads=4)  # D = C * p * p
    x = torch.randn(2, 3, 16, 32)
    patches = model.patchify(x)
    assert patches.shape == (2, 32, 48)
    assert torch.equal(model.unpatchify(patches), x)
    # Patch (row 1, column 2), channel 2, pixel (3, 0) sits at token 1 * 8 + 2, feature 2 * 16 + 3 * 4 + 0.
    assert patches[1, 10, 2 * 16 + 12] == x[1, 2, 4 + 3, 8 + 0]
    # An identity head maps the patchified input straight back.
    with torch.no_grad():
        model.head.weight.copy_(torch.eye(48))
    assert torch.equal(model.unpatchify(model.head(patches)), x)
    # The Linear patch embedding is NERSC's Conv2d(kernel=stride=p) with the same weight reshaped.
    w = model.patch_embed.weight.view(48, 3, 4, 4)
    conv = F.conv2d(x, w, model.patch_embed.bias, stride=4).flatten(2).transpose(1, 2)
    torch.testing.assert_close(model.patch_embed(patches), conv, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kw", [dict(SMALL), dict(SMALL, bias=False), dict(SMALL, out_channels=7, mlp_ratio=3.0),
                                preset("tiny")])
def test_param_count_and_flops(kw):
    cfg = ViTConfig(**kw)
    model = ViT(cfg)
    assert model.num_params() == analytic_params(cfg)
    assert model.num_matmul_params() == analytic_matmul_params(cfg)
    N, D, L = cfg.num_patches, cfg.embed_dim, cfg.depth
    expected = 6 * analytic_matmul_params(cfg) * N + 12 * L * N * N * D
    assert model.flops_per_sample() == expected
    assert model.flops_per_token() * N == expected


def test_base_and_mp_presets_on_meta():
    with torch.device("meta"):
        base, mp = ViT(ViTConfig(**preset("base"))), ViT(ViTConfig(**preset("mp")))
    assert base.config.num_patches == 45 * 90
    assert base.num_matmul_params() == 22_216_704  # 12 * 12 * 384^2 blocks + 2 * 1280 * 384 embed and head
    assert base.num_params() == analytic_params(base.config)
    attention = 12 * 12 * 4050 ** 2 * 384
    assert base.flops_per_sample() == 6 * 22_216_704 * 4050 + attention
    assert attention / base.flops_per_sample() == pytest.approx(0.627, abs=0.001)
    assert mp.config.embed_dim == 1024 and mp.num_params() == analytic_params(mp.config)


def test_losses():
    model = small()
    pred, target = torch.randn(2, 3, 3, 16, 32)
    torch.testing.assert_close(model.loss(pred, target), F.mse_loss(pred, target))
    hand = np.mean([np.linalg.norm((pred[b] - target[b]).numpy()) / np.linalg.norm(target[b].numpy())
                    for b in range(3)])
    assert relative_l2_loss(pred, target).item() == pytest.approx(hand, rel=1e-5)
    assert small(loss="relative_l2").loss(pred, target).item() == pytest.approx(hand, rel=1e-5)
    with pytest.raises(ValueError, match="differ in shape"):
        model.loss(pred, target[:, :2])


def test_one_step_reduces_loss_and_overfits_tiny_batch():
    model = small()
    torch.manual_seed(1)
    x = torch.randn(2, 3, 16, 32)
    y = torch.roll(x, shifts=3, dims=-1)  # an "advection" step: every field moves 3 columns east
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(50):
        loss = model.loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        final = model.loss(model(x), y).item()
    assert losses[1] < losses[0]
    assert final < 0.15 * losses[0], (losses[0], final)  # measured: 1.077 -> 0.079


def test_rmse_in_physical_units():
    torch.manual_seed(0)
    pred, target = torch.randn(2, 3, 3, 4, 6)  # B=3, C=3
    means, stds = np.array([280.0, 5.0, 1e5]), np.array([20.0, 3.0, 900.0])
    for c in range(3):
        p = pred.numpy()[:, c] * stds[c] + means[c]
        t = target.numpy()[:, c] * stds[c] + means[c]
        hand = np.mean([np.sqrt(np.mean((p[b] - t[b]) ** 2)) for b in range(3)])
        got = rmse(pred, target, means=means, stds=stds, channel=c)
        assert got.item() == pytest.approx(hand, rel=1e-5)
    # Without stds: normalised units; one sample [C, H, W] is a batch of one.
    hand0 = np.sqrt(np.mean((pred[0, 1] - target[0, 1]).numpy() ** 2))
    assert rmse(pred[0], target[0], channel=1).item() == pytest.approx(hand0, rel=1e-6)
    with pytest.raises(ValueError, match="stds has 2 values"):
        rmse(pred, target, stds=stds[:2])


def test_latitude_weighted_rmse_matches_numpy():
    torch.manual_seed(0)
    B, C, H, W = 3, 4, 6, 10
    pred, target = torch.randn(2, B, C, H, W)
    lat = np.linspace(90.0, -90.0, 9)[:H]  # a cropped grid: its own rows set the weights
    stds = np.array([1.0, 2.0, 0.5, 10.0])
    weights = np.cos(np.deg2rad(lat))
    weights = weights / weights.mean()
    err2 = (pred.numpy().astype(np.float64) - target.numpy()) ** 2
    hand = np.zeros(C)
    for c in range(C):
        hand[c] = np.mean([np.sqrt(np.mean(weights[:, None] * err2[b, c])) for b in range(B)]) * stds[c]
    got = latitude_weighted_rmse(pred, target, lat, stds)
    assert got.shape == (C,)
    np.testing.assert_allclose(got.numpy(), hand, rtol=1e-5)
    # Equal errors everywhere: the weights have mean 1, so the weighted RMSE is the error.
    ones = latitude_weighted_rmse(torch.full((1, 2, H, W), 0.5), torch.zeros(1, 2, H, W), lat)
    torch.testing.assert_close(ones, torch.tensor([0.5, 0.5]))
    with pytest.raises(ValueError, match="lat has 9 rows"):
        latitude_weighted_rmse(pred, target, np.linspace(90.0, -90.0, 9))


def test_attention_follows_local_head_count():
    # A tensor-parallel shard holds num_heads/tp heads: q/k/v_proj output D/tp each, c_proj takes D/tp.
    # Slicing whole heads' q, k, v rows and c_proj columns must give those heads' contribution.
    model = small(bias=False).eval()
    attn = model.blocks["1"].attn
    D, hd = 32, attn.head_dim
    x = torch.randn(2, 32, D)
    full = attn(x)
    total = torch.zeros_like(full)
    tp = 2
    per = D // tp  # two heads per shard
    for r in range(tp):
        shard = type(attn).__new__(type(attn))
        torch.nn.Module.__init__(shard)
        for name in ("q_proj", "k_proj", "v_proj"):
            proj = torch.nn.Linear(D, per, bias=False)
            proj.weight.data = getattr(attn, name).weight.data[r * per:(r + 1) * per]
            setattr(shard, name, proj)
        shard.c_proj = torch.nn.Linear(per, D, bias=False)
        shard.c_proj.weight.data = attn.c_proj.weight.data[:, r * per:(r + 1) * per]
        shard.resid_dropout, shard.dropout, shard.head_dim, shard.attend = attn.resid_dropout, 0.0, hd, attn.attend
        total += shard(x)
    torch.testing.assert_close(total, full, rtol=1e-5, atol=1e-6)


def test_token_seam_and_token_positions():
    model = small().eval()
    x = torch.randn(2, 3, 16, 32)
    steps = model.unpatchify(model.head(model.forward_tokens(model.embed(x))))
    assert torch.equal(model(x), steps)
    tokens = model.embed(x)
    positions = torch.tensor([0, 31, 5, 6, 17])  # any order, e.g. the ring's zigzag
    torch.testing.assert_close(model.embed(x, positions), tokens[:, positions], rtol=0, atol=1e-6)
    # Attention is not causal and positions enter only in embed, so the blocks commute with any reordering
    # of the tokens: what a context-parallel rank relies on when it holds tokens out of order.
    perm = torch.randperm(32, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model.forward_tokens(model.embed(x, perm)), model.forward_tokens(tokens)[:, perm],
                               rtol=1e-5, atol=1e-5)
    # Attention is full: the last token's output depends on the first patch.
    changed = x.clone()
    changed[:, :, :4, :4] += 1.0
    assert not torch.allclose(model.forward_tokens(model.embed(changed))[:, -1], model.forward_tokens(tokens)[:, -1])
    with pytest.raises(ValueError, match="gather all tokens"):
        model.unpatchify(model.head(tokens[:, :10]))


def test_input_checks_and_config_validation():
    model = small()
    with pytest.raises(ValueError, match="crop the data"):
        model(torch.randn(1, 3, 16, 30))
    with pytest.raises(ValueError, match="3 input channels, got 4"):
        model(torch.randn(1, 4, 16, 32))
    for kw, match in [(dict(img_size=(16, 30)), "img_size width .30. must be divisible by patch_size .4."),
                      (dict(embed_dim=30), "embed_dim .30. must be divisible by num_heads .4."),
                      (dict(depth=0), "ViTConfig.depth must be a positive integer"),
                      (dict(in_channels=2.0), "ViTConfig.in_channels"),
                      (dict(img_size=(16,)), "ViTConfig.img_size must be"),
                      (dict(dropout=1.0), "ViTConfig.dropout"),
                      (dict(mlp_ratio=0.0), "ViTConfig.mlp_ratio"),
                      (dict(loss="l1"), "ViTConfig.loss")]:
        with pytest.raises(ValueError, match=match):
            ViTConfig(**{**SMALL, **kw})
    assert ViTConfig(**{**SMALL, "img_size": [16, 32]}).img_size == (16, 32)  # YAML lists are fine


def test_init_statistics_and_meta_build():
    torch.manual_seed(0)
    model = ViT(ViTConfig(**{**SMALL, "embed_dim": 256, "num_heads": 4}))
    blk = model.blocks["1"]
    for w in (blk.mlp.c_fc.weight, blk.mlp.c_proj.weight, blk.attn.q_proj.weight, model.head.weight):
        assert w.std().item() == pytest.approx(0.02, rel=0.03)
    assert model.pos_embed.std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.all(blk.attn.c_proj.bias == 0) and torch.all(model.patch_embed.bias == 0)
    assert torch.all(blk.ln_1.weight == 1) and torch.all(model.norm.bias == 0)
    assert model.norm.eps == 1e-6
    with torch.device("meta"):
        meta = ViT(ViTConfig(**SMALL))
    meta.to_empty(device="cpu")
    meta.init_weights()
    y = meta(torch.randn(1, 3, 16, 32))
    assert torch.isfinite(y).all() and meta.num_params() == analytic_params(meta.config)


def test_optimizer_groups_partition_params():
    model = small()
    decay, no_decay = model.configure_optimizer_groups(0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    ids = [id(p) for g in (decay, no_decay) for p in g["params"]]
    assert len(ids) == len(set(ids)) and set(ids) == {id(p) for p in model.parameters()}
    assert all(p.dim() == 2 for p in decay["params"])  # the Linear weights
    assert any(p is model.pos_embed for p in no_decay["params"])  # as timm's ViT


def test_bf16_autocast_on_cpu_and_drop_path_schedule():
    model = small(drop_path=0.2, depth=3)
    assert [b.drop_path.p for b in model.blocks.values()] == pytest.approx([0.0, 0.1, 0.2])
    model.eval()
    x = torch.randn(2, 3, 16, 32)
    ref = model(x)
    torch.testing.assert_close(model(x), ref)  # eval: no stochastic depth
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x)
    assert y.dtype == torch.bfloat16
    assert (y.float() - ref).abs().max().item() < 0.05 * ref.abs().max().item() + 0.05
    assert math.isfinite(model.loss(y.float(), ref).item())
