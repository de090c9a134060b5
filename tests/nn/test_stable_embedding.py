"""qshard.nn.StableEmbedding against nn.Embedding + an fp32 LayerNorm written in the test."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qshard.nn import StableEmbedding
from qshard.optim._overrides import is_full_precision_param


def test_forward_equals_embedding_then_fp32_layer_norm():
    torch.manual_seed(0)
    emb = StableEmbedding(50, 16, padding_idx=3)
    with torch.no_grad():
        emb.norm.weight.uniform_(0.5, 1.5)
        emb.norm.bias.uniform_(-0.1, 0.1)
    idx = torch.tensor([[0, 3, 7], [49, 3, 1]])
    ref = F.layer_norm(emb.weight[idx], (16,), emb.norm.weight, emb.norm.bias, 1e-5)
    torch.testing.assert_close(emb(idx), ref)
    assert bool((emb.weight[3] == 0).all())  # padding row zeroed after the Xavier init


def test_bf16_weight_normalises_in_fp32_and_returns_bf16():
    torch.manual_seed(0)
    emb = StableEmbedding(20, 8, dtype=torch.bfloat16)
    idx = torch.tensor([1, 2, 5])
    out = emb(idx)
    assert out.dtype == torch.bfloat16
    assert emb.norm.weight.dtype == torch.bfloat16  # one dtype per module (FSDP2 units)
    w, b = emb.norm.weight.float(), emb.norm.bias.float()
    ref = F.layer_norm(emb.weight[idx].float(), (8,), w, b, 1e-5)
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)


def test_weight_is_registered_for_32bit_state_by_name():
    emb = StableEmbedding(20, 8)
    assert is_full_precision_param(emb.weight)
    assert not is_full_precision_param(emb.norm.weight)
    # Replacing the parameter (as FSDP2 does) keeps the override: it is keyed by name.
    emb.weight = torch.nn.Parameter(emb.weight.detach().clone())
    assert is_full_precision_param(emb.weight)


def test_from_pretrained_keeps_the_table_and_its_32bit_state():
    # nn.Embedding.from_pretrained passes _weight/_freeze, which StableEmbedding did not take.
    table = torch.randn(10, 4)
    emb = StableEmbedding.from_pretrained(table, freeze=False, padding_idx=2)
    assert torch.equal(emb.weight, table) and emb.weight.requires_grad and emb.padding_idx == 2
    assert torch.equal(emb.norm.weight, torch.ones(4))
    assert torch.equal(emb.norm.bias, torch.zeros(4))
    assert is_full_precision_param(emb.weight)
    ref = F.layer_norm(table[torch.tensor([1, 2])], (4,), None, None, 1e-5)
    torch.testing.assert_close(emb(torch.tensor([1, 2])), ref)
    assert not StableEmbedding.from_pretrained(table).weight.requires_grad  # freeze=True default


def test_reset_parameters_after_meta_init_resets_the_norm_too():
    emb = StableEmbedding(10, 4, padding_idx=1, device="meta")
    emb.to_empty(device="cpu")
    with torch.no_grad():
        emb.norm.weight.fill_(float("nan"))  # what to_empty may leave behind
        emb.norm.bias.fill_(float("nan"))
    emb.reset_parameters()
    assert torch.equal(emb.norm.weight, torch.ones(4))
    assert torch.equal(emb.norm.bias, torch.zeros(4))
    assert bool((emb.weight[1] == 0).all()) and bool(torch.isfinite(emb.weight).all())
