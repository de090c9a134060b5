"""Shared checks of the optimizer tests."""

from __future__ import annotations

import torch


def assert_same_bits(a, b, where) -> None:
    """Two ``(parameter, optimizer)`` pairs hold bit-identical parameters and state tensors
    (float tensors compared as int32 patterns, so NaNs and signed zeros count too)."""
    (p1, o1), (p2, o2) = a, b
    assert torch.equal(p1.detach().view(torch.int32), p2.detach().view(torch.int32)), where
    for k, v in o1.state[p1].items():
        w = o2.state[p2][k]
        if v.dtype == torch.float32:
            v, w = v.view(torch.int32), w.view(torch.int32)
        assert torch.equal(v, w), (where, k)
