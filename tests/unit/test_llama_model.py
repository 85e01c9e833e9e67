"""The Llama-style decoder: its parts against their definitions, its counts, and its registration."""

import math

import pytest
import torch
import torch.nn.functional as F

from meshtrain import registry
from meshtrain.config import ConfigError, load_config
from meshtrain.models.llama.model import Llama, LlamaConfig
from meshtrain.nn.transformer import rope_tables, rotate
from meshtrain.parallel.mesh import MeshError, ParallelDims

TINY = dict(block_size=16, vocab_size=65, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=64)


def test_rope_scores_depend_only_on_the_offset_and_keep_norms():
    q, k = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    scores = [rotate(q, *rope_tables(torch.arange(8) + shift, 16)) @ rotate(k, *rope_tables(torch.arange(8) + shift,
                                                                                               16)).transpose(-1, -2)
              for shift in (0, 37)]
    torch.testing.assert_close(scores[0], scores[1], atol=1e-4, rtol=1e-4)
    rotated = rotate(q, *rope_tables(torch.arange(8), 16))
    torch.testing.assert_close(rotated.norm(dim=-1), q.norm(dim=-1))
    torch.testing.assert_close(rotated[:, :, 0], q[:, :, 0])  # position 0 turns by nothing


def test_grouped_query_attention_is_multi_head_attention_with_repeated_keys_and_values():
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**TINY))
    attn = model.transformer.h["0"].attn
    x = torch.randn(2, 8, 32)
    rope = rope_tables(torch.arange(8), 8)
    q = rotate(attn.q_proj(x).view(2, 8, 4, 8).transpose(1, 2), *rope)
    k = rotate(attn.k_proj(x).view(2, 8, 2, 8).transpose(1, 2), *rope)
    v = attn.v_proj(x).view(2, 8, 2, 8).transpose(1, 2)
    # query heads 0, 1 read key/value head 0; heads 2, 3 read head 1
    y = F.scaled_dot_product_attention(q, k[:, [0, 0, 1, 1]], v[:, [0, 0, 1, 1]], is_causal=True)
    expected = attn.c_proj(y.transpose(1, 2).reshape(2, 8, 32))
    torch.testing.assert_close(attn(x, rope=rope), expected)


def test_swiglu_and_rmsnorm_follow_their_definitions():
    torch.manual_seed(0)
    block = Llama(LlamaConfig(**TINY)).transformer.h["0"]
    x = torch.randn(3, 32)
    mlp = block.mlp
    torch.testing.assert_close(mlp(x), mlp.c_proj(F.silu(mlp.c_gate(x)) * mlp.c_fc(x)))
    torch.testing.assert_close(block.ln_1(x), x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))


def test_head_is_untied_and_counts_match_the_formulas():
    model = Llama(LlamaConfig(**TINY))
    assert model.lm_head.weight is not model.transformer.wte.weight
    c = model.config
    per_block = 32 * 32 * 2 + 2 * 32 * 16 + 3 * 32 * 64 + 2 * 32  # q, c_proj; k, v (2 kv heads of 8); SwiGLU; norms
    assert model.num_params() == c.n_layer * per_block + 32 + 65 * 32  # + final norm + head (wte left out)
    assert model.num_params(non_embedding=False) == model.num_params() + 65 * 32
    assert model.flops_per_token() == 6 * model.num_params() + 12 * 2 * 4 * 8 * 16


def test_positions_are_the_context_parallel_seam():
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**TINY)).eval()
    idx = torch.randint(0, 65, (2, 16))
    logits, _ = model(idx, idx)
    same, _ = model(idx, idx, positions=torch.arange(16))
    torch.testing.assert_close(same, logits)
    shifted, _ = model(idx, idx, positions=torch.arange(16) + 3)  # RoPE: only offsets matter within the window
    torch.testing.assert_close(shifted, logits, atol=1e-4, rtol=1e-4)


def test_it_learns_a_batch_and_samples():
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**TINY))
    idx = torch.randint(0, 65, (4, 16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for _ in range(40):
        _, loss = model(idx[:, :-1], idx[:, 1:])
        first = first if first is not None else loss.item()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert first == pytest.approx(math.log(65), rel=0.1) and loss.item() < 0.5
    out = model.eval().generate(idx[:1, :4], 6, temperature=0)
    assert out.shape == (1, 10) and torch.equal(out[:, :4], idx[:1, :4])


def test_registered_with_its_presets_shape_and_rules():
    spec = registry.get("llama")
    assert "llama" in registry.names() and spec.text
    cfg = load_config(["preset=cpu"], "llama")
    assert cfg.data.name == "shakespeare" and cfg.model.n_kv_head == 2
    shape = spec.shape(cfg)
    assert (shape.heads, shape.kv_heads, shape.mlp_hidden, shape.tokens) == (4, 2, 384, 64)  # 8/3 × 128 -> 384
    model = spec.build_model(cfg, {"meta": {"vocab_size": 65}})
    assert model.config.ffn_hidden == shape.mlp_hidden and len(model.transformer.h) == shape.layers
    with pytest.raises(ConfigError, match="model.n_head=4 is not a multiple of model.n_kv_head=3"):
        load_config(["preset=cpu", "model.n_kv_head=3"], "llama")
    with pytest.raises(MeshError, match="model.n_kv_head=2 is not divisible by parallel.tp=4"):
        ParallelDims.from_config(load_config(["preset=cpu", "parallel.tp=4", "train.backend=fsdp"], "llama"), 4, 4)
