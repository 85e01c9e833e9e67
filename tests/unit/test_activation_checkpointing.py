"""Activation checkpointing recomputes exactly what it drops, keeps fewer activations, and renames nothing."""

import pytest
import torch

from meshtrain.models.gpt.model import GPT, GPTConfig
from meshtrain.parallel.checkpointing import apply_activation_checkpointing

CONFIG = GPTConfig(block_size=16, vocab_size=65, n_layer=4, n_head=2, n_embd=32, dropout=0.1, bias=True)


def train_step(mode: str):
    torch.manual_seed(0)
    model = GPT(CONFIG)
    wrapped = apply_activation_checkpointing(model.transformer.h, mode, every=2)
    x = torch.randint(0, 65, (4, 16), generator=torch.Generator().manual_seed(1))
    saved = [0]

    def pack(t):
        saved[0] += t.numel()
        return t

    torch.manual_seed(5)  # the same dropout masks; recomputation must replay them
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = model(x, torch.roll(x, -1, 1))
    loss.backward()
    grads = {name.replace("_checkpoint_wrapped_module.", ""): p.grad for name, p in model.named_parameters()}
    return loss.item(), grads, saved[0], wrapped, list(model.state_dict())


@pytest.mark.parametrize("mode,wrapped", [("full", 4), ("selective", 2)])
def test_recomputation_is_exact_and_saves_memory(mode, wrapped):
    loss, grads, saved, n, keys = train_step(mode)
    base_loss, base_grads, base_saved, _, base_keys = train_step("none")
    assert n == wrapped
    assert loss == base_loss
    assert all(torch.equal(grads[k], base_grads[k]) for k in base_grads)
    assert keys == base_keys, "checkpoints keep their parameter names"
    assert saved < base_saved * (0.2 if mode == "full" else 0.7), "fewer activations are kept for backward"


def test_unknown_mode_is_an_error():
    with pytest.raises(ValueError, match="choose one of none, full, selective"):
        apply_activation_checkpointing(GPT(CONFIG).transformer.h, "some")
