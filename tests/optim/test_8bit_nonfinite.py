"""Non-finite values in 8-bit optimizer state: a NaN or +-Inf gradient is never quantized into a
finite state. Every update kind, on the three CPU paths (the fused C kernel, its scalar
``-mno-avx2`` build, the torch reference path): a state block that holds a NaN/Inf after the
update stores a NaN absmax and zero codes and decodes to NaN everywhere (the kernel's
[Note: non-finite state blocks]); the other blocks are untouched by it; the parameters that saw
a non-finite gradient are non-finite (Lion's sign of NaN stays NaN). Subnormal gradients stay
finite. The Triton kernel's side is in tests/gpu/test_optim8bit.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

from qshard.optim import _kernels, _qstate
from tests.optim.test_8bit_kernel import _ONE_STEP, _scalar_library, _warm

pytestmark = pytest.mark.skipif(not _kernels.available(), reason="no C compiler for the kernel")

SHAPE = (10, 512)  # >= min_8bit_size; block 256: rows of 2 blocks, 20 blocks in all
BAD = {0: float("nan"), 3: float("inf"), 6: float("-inf")}  # block -> the value put in it
SUBNORMAL_BLOCK = 9


def _poisoned_grad(shape: tuple[int, int], seed: int) -> torch.Tensor:
    g = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.3
    flat = g.view(-1)
    for block, value in BAD.items():
        flat[block * 256 + 17] = value
    tiny = torch.finfo(torch.float32).tiny
    flat[SUBNORMAL_BLOCK * 256 : (SUBNORMAL_BLOCK + 1) * 256] = tiny * 2**-10  # subnormal
    return g


def _step_on(backend: str, cls, kw, p0, opt0, grad, monkeypatch):
    p = torch.nn.Parameter(p0.detach().clone())
    p.grad = grad.clone()
    opt = cls([p], **kw)
    opt.load_state_dict(copy.deepcopy(opt0.state_dict()))
    if backend == "reference":
        monkeypatch.setattr(_kernels, "library", lambda: None)
    elif backend == "scalar":
        scalar = _scalar_library()
        monkeypatch.setattr(_kernels, "library", lambda: scalar)
    opt.step()
    monkeypatch.undo()
    return p, opt


def _blocks_of(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, 256)


@pytest.mark.parametrize("backend", ["kernel", "scalar", "reference"])
@pytest.mark.parametrize(("cls", "kw"), _ONE_STEP, ids=[c.__name__ for c, _ in _ONE_STEP])
def test_nonfinite_gradients_make_their_state_blocks_nan(backend, cls, kw, monkeypatch):
    p0, opt0 = _warm(cls, kw, SHAPE)
    grad = _poisoned_grad(SHAPE, seed=1)
    p, opt = _step_on(backend, cls, kw, p0, opt0, grad, monkeypatch)
    finite_grad = torch.where(grad.isfinite(), grad, 0.0)
    clean, _ = _step_on("kernel", cls, kw, p0, opt0, finite_grad, monkeypatch)
    bad = torch.zeros(SHAPE[0] * SHAPE[1] // 256, dtype=torch.bool)
    bad[list(BAD)] = True
    specs = opt._state_specs(opt.param_groups[0])
    for name, signed in specs:
        codes, absmax = opt.state[p][f"{name}_codes"], opt.state[p][f"{name}_absmax"]
        flat_absmax = absmax.reshape(-1)
        assert torch.equal(flat_absmax.isnan(), bad), (name, flat_absmax)
        zero = _qstate.qmap(signed).zero_idx
        assert bool((_blocks_of(codes)[bad] == zero).all()), name  # zero codes
        decoded = _qstate.dequantize_rows(codes, absmax, _qstate.qmap(signed), 256)
        assert bool(_blocks_of(decoded)[bad].isnan().all()), name  # NaN for the whole block
        assert bool(_blocks_of(decoded)[~bad].isfinite().all()), name
    # The parameters that saw a non-finite gradient are non-finite (Lion steps by sign(c): an
    # infinite c is a step of lr, its state block is NaN from then on); subnormal ones finite.
    for block, value in BAD.items():
        if cls.__name__ == "Lion8bit" and value != float("nan") and abs(value) == float("inf"):
            continue
        assert not bool(p.detach().view(-1)[block * 256 + 17].isfinite()), (block, backend)
    sub = slice(SUBNORMAL_BLOCK * 256, (SUBNORMAL_BLOCK + 1) * 256)
    assert bool(p.detach().view(-1)[sub].isfinite().all())
    # Blocks without a non-finite value are not disturbed by the ones with one.
    good = ~bad.repeat_interleave(256)
    same = p.detach().view(-1)[good] - clean.detach().view(-1)[good]
    if backend == "reference":  # float rounding (tests/optim/test_8bit_kernel.py)
        assert float(same.abs().max()) < 1e-5
    else:
        assert torch.equal(same, torch.zeros_like(same))


def test_a_nan_state_block_stays_nan_on_later_steps():
    """Once a block is NaN it stays NaN (it is never re-quantized to a finite value): the next
    step decodes NaN and so writes NaN parameters over the whole block."""
    p0, opt = _warm(_ONE_STEP[1][0], _ONE_STEP[1][1], SHAPE)
    p0.grad = _poisoned_grad(SHAPE, seed=2)
    opt.step()
    p0.grad = torch.randn(SHAPE) * 0.3
    opt.step()
    flat = p0.detach().view(-1, 256)
    assert bool(flat[list(BAD)].isnan().all())
    others = [b for b in range(flat.shape[0]) if b not in BAD]
    assert bool(flat[others].isfinite().all())
