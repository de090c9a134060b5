"""The GPT model: config validation, shapes, deterministic init, tying, loss vs float math."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from qshard.train.model import GPT, GPTConfig

TINY = dict(vocab_size=64, context=16, n_layer=2, n_head=2, n_embd=32)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(n_embd=30, n_head=4), "divisible by n_head"),
        (dict(n_layer=0), "n_layer must be a positive int"),
        (dict(dropout=1.0), "dropout"),
        (dict(stable_embedding=True, tie_head=True), "tie_head=False"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**kwargs)


def test_config_is_kw_only_and_frozen():
    with pytest.raises(TypeError):
        GPTConfig(256)  # type: ignore[misc]
    cfg = GPTConfig()
    with pytest.raises((AttributeError, TypeError)):
        cfg.n_layer = 3  # type: ignore[misc]


def test_forward_shapes_and_initial_loss():
    model = GPT(GPTConfig(**TINY))
    idx = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(1))
    logits, loss = model(idx, targets)
    assert logits.shape == (3, 16, 64)
    # Small init -> near-uniform predictions on unrelated targets: loss close to ln(vocab).
    assert abs(loss.item() - math.log(64)) < 0.1
    ref = F.cross_entropy(logits.view(-1, 64), targets.view(-1))
    torch.testing.assert_close(loss, ref)
    assert model(idx)[1] is None
    with pytest.raises(ValueError, match=r"exceeds GPTConfig\.context"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_init_is_deterministic_and_seeded_independent_of_global_rng():
    torch.manual_seed(1)
    a = GPT(GPTConfig(**TINY, seed=3))
    torch.manual_seed(2)
    b = GPT(GPTConfig(**TINY, seed=3))
    c = GPT(GPTConfig(**TINY, seed=4))
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.blocks[0].attn.qkv.weight, c.blocks[0].attn.qkv.weight)


def test_tied_and_untied_head():
    tied = GPT(GPTConfig(**TINY, tie_head=True))
    untied = GPT(GPTConfig(**TINY, tie_head=False))
    assert tied.head.weight is tied.tok_emb.weight
    assert untied.head.weight is not untied.tok_emb.weight
    assert untied.num_params() - tied.num_params() == 64 * 32


def test_causality():
    model = GPT(GPTConfig(**TINY)).eval()
    idx = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(1))
    idx2 = idx.clone()
    idx2[0, 10:] = (idx2[0, 10:] + 1) % 64
    la, _ = model(idx)
    lb, _ = model(idx2)
    torch.testing.assert_close(la[:, :10], lb[:, :10])
    assert not torch.allclose(la[:, 10:], lb[:, 10:])


def test_a_few_steps_reduce_loss():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    idx = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(2))
    first = None
    for _ in range(20):
        _, loss = model(idx[:, :-1], idx[:, 1:])
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < first - 0.5


def test_stable_embedding_option():
    from qshard.nn import StableEmbedding

    a = GPT(GPTConfig(**TINY, stable_embedding=True, tie_head=False, seed=5))
    b = GPT(GPTConfig(**TINY, stable_embedding=True, tie_head=False, seed=5))
    assert isinstance(a.tok_emb, StableEmbedding)
    assert torch.equal(a.tok_emb.weight, b.tok_emb.weight)
    bound = math.sqrt(6.0 / (64 + 32))  # Xavier uniform over (vocab, width)
    assert a.tok_emb.weight.abs().max() <= bound
    assert a.tok_emb.weight.std() > 0.5 * bound / math.sqrt(3)
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    logits, loss = a(idx, idx)
    assert logits.shape == (2, 16, 64) and torch.isfinite(loss)
