"""Non-finite values in 4-bit optimizer state, the 8-bit state's contract
(tests/optim/test_8bit_nonfinite.py): a NaN or +-Inf gradient is never quantized into a finite
state. On the three CPU paths (the fused C kernel, its scalar ``-mno-avx2`` build, the torch
reference), for every weight-decay mode and second-moment map: a block of m or v that holds a
NaN/Inf after the update stores a NaN absmax and the code of 0.0 and decodes to NaN; the other
blocks are untouched by it (bit for bit); the three paths write the same bits; the parameters
that saw a non-finite gradient are non-finite; subnormal gradients stay finite. The encoders
alone (torch and C ``quantize_rows4``) follow the same rule. The Triton kernel's side is in
tests/gpu/test_optim4bit.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

from qshard.optim import _kernels4, _qstate4
from qshard.optim.adam4bit import Adam4bit, AdamW4bit
from tests.optim.test_4bit_kernel import _kernel_quantize, _scalar_library, _warm

pytestmark = pytest.mark.skipif(not _kernels4.available(), reason="no C compiler for the kernel")

SHAPE = (10, 512)  # block 128: rows of 4 blocks, 40 blocks in all
BLOCK = 128
BAD = {0: float("nan"), 5: float("inf"), 10: float("-inf")}  # block -> the value put in it
SUBNORMAL_BLOCK = 13

_CASES = [
    (AdamW4bit, dict(lr=1e-2, weight_decay=0.1)),  # decoupled decay
    (Adam4bit, dict(lr=1e-2, weight_decay=0.1)),  # L2 decay into the gradient
    (Adam4bit, dict(lr=1e-2, betas=(0.8, 0.95))),  # neither
    (AdamW4bit, dict(lr=1e-2, second_moment_map="dynamic")),
    (AdamW4bit, dict(lr=1e-2, second_moment_map="linear-zero")),
]
_IDS = [f"{c.__name__}-{'-'.join(f'{k}={v}' for k, v in kw.items())}" for c, kw in _CASES]


def _poisoned_grad(seed: int) -> torch.Tensor:
    g = torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)) * 0.3
    flat = g.view(-1)
    for block, value in BAD.items():
        flat[block * BLOCK + 17] = value
    tiny = torch.finfo(torch.float32).tiny
    flat[SUBNORMAL_BLOCK * BLOCK : (SUBNORMAL_BLOCK + 1) * BLOCK] = tiny * 2**-10  # subnormal
    return g


def _step_on(backend, cls, kw, p0, opt0, grad, monkeypatch):
    p = torch.nn.Parameter(p0.detach().clone())
    p.grad = grad.clone()
    opt = cls([p], min_4bit_size=0, **kw)
    opt.load_state_dict(copy.deepcopy(opt0.state_dict()))
    if backend == "reference":
        monkeypatch.setattr(_kernels4, "library", lambda: None)
    elif backend == "scalar":
        scalar = _scalar_library()
        monkeypatch.setattr(_kernels4, "library", lambda: scalar)
    opt.step()
    monkeypatch.undo()
    return p, opt


def _zero_code(q) -> int:
    return int(torch.bucketize(torch.tensor(0.0), q.mid))


def _bad_blocks() -> torch.Tensor:
    bad = torch.zeros(SHAPE[0] * SHAPE[1] // BLOCK, dtype=torch.bool)
    bad[list(BAD)] = True
    return bad


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaN where the other is NaN (a NaN's sign and payload are not part of the contract)."""
    if not torch.equal(a.isnan(), b.isnan()):
        return False
    keep = ~a.isnan()
    return torch.equal(a[keep].view(torch.int32), b[keep].view(torch.int32))


def _run_all(cls, kw, monkeypatch):
    p0, opt0 = _warm(cls, kw, SHAPE)
    grad = _poisoned_grad(seed=1)
    runs = {b: _step_on(b, cls, kw, p0, opt0, grad, monkeypatch) for b in _BACKENDS}
    clean_grad = torch.where(grad.isfinite(), grad, 0.0)
    clean = _step_on("kernel", cls, kw, p0, opt0, clean_grad, monkeypatch)
    return grad, runs, clean


_BACKENDS = ("kernel", "scalar", "reference")


@pytest.mark.parametrize(("cls", "kw"), _CASES, ids=_IDS)
def test_nonfinite_gradients_make_their_state_blocks_nan_on_every_path(cls, kw, monkeypatch):
    _, runs, (clean, clean_opt) = _run_all(cls, kw, monkeypatch)
    bad = _bad_blocks()
    for backend, (p, opt) in runs.items():
        qm, qv = opt._maps(opt.param_groups[0])
        for name, q in (("exp_avg", qm), ("exp_avg_sq", qv)):
            codes, absmax = opt.state[p][f"{name}_codes"], opt.state[p][f"{name}_absmax"]
            assert torch.equal(absmax.reshape(-1).isnan(), bad), (backend, name, absmax)
            nibbles = _qstate4.unpack(codes, SHAPE[1]).reshape(-1, BLOCK)
            assert bool((nibbles[bad] == _zero_code(q)).all()), (backend, name)
            decoded = _qstate4.dequantize_rows4(codes, absmax, q, BLOCK, SHAPE).reshape(-1, BLOCK)
            assert bool(decoded[bad].isnan().all()), (backend, name)  # NaN for the whole block
            assert bool(decoded[~bad].isfinite().all()), (backend, name)
            # blocks without a non-finite value are not disturbed by the ones with one
            ref_codes = _qstate4.unpack(clean_opt.state[clean][f"{name}_codes"], SHAPE[1])
            assert torch.equal(nibbles[~bad], ref_codes.reshape(-1, BLOCK)[~bad]), backend
            ref_absmax = clean_opt.state[clean][f"{name}_absmax"].reshape(-1)
            assert torch.equal(absmax.reshape(-1)[~bad], ref_absmax[~bad]), backend
        flat = p.detach().view(-1)
        for block in BAD:
            assert not bool(flat[block * BLOCK + 17].isfinite()), (block, backend)
        sub = slice(SUBNORMAL_BLOCK * BLOCK, (SUBNORMAL_BLOCK + 1) * BLOCK)
        assert bool(flat[sub].isfinite().all()), backend
        good = ~bad.repeat_interleave(BLOCK)
        assert torch.equal(flat[good], clean.detach().view(-1)[good]), backend
    # The three paths write the same bits (NaN where the others have NaN).
    (pk, ok) = runs["kernel"]
    for backend in ("scalar", "reference"):
        p, opt = runs[backend]
        assert _same_bits(p.detach(), pk.detach()), backend
        for k, v in ok.state[pk].items():
            w = opt.state[p][k]
            assert _same_bits(w, v) if w.is_floating_point() else torch.equal(w, v), (backend, k)


def test_a_nan_state_block_stays_nan_on_later_steps(monkeypatch):
    """Once a block is NaN it is never re-quantized to a finite value: the next step decodes NaN
    and writes NaN parameters over the whole block, on every path alike."""
    for backend in _BACKENDS:
        p, opt = _warm(AdamW4bit, dict(lr=1e-2, weight_decay=0.1), SHAPE)
        if backend == "reference":
            monkeypatch.setattr(_kernels4, "library", lambda: None)
        elif backend == "scalar":
            scalar = _scalar_library()
            monkeypatch.setattr(_kernels4, "library", lambda s=scalar: s)
        p.grad = _poisoned_grad(seed=2)
        opt.step()
        p.grad = torch.randn(SHAPE) * 0.3
        opt.step()
        monkeypatch.undo()
        flat = p.detach().view(-1, BLOCK)
        assert bool(flat[list(BAD)].isnan().all()), backend
        others = [b for b in range(flat.shape[0]) if b not in BAD]
        assert bool(flat[others].isfinite().all()), backend


@pytest.mark.parametrize("name", ["signed-dynamic", *_qstate4.SECOND_MOMENT_MAPS])
def test_encoders_store_nan_absmax_and_the_code_of_zero(name):
    """torch's quantize_rows4 and the C one: a block with NaN, Inf or -Inf (odd rows: a half
    byte at the end) gets a NaN absmax and the code of 0.0; the others are encoded as usual."""
    q = _qstate4.qmap4(name)
    x = torch.randn(3, 301, generator=torch.Generator().manual_seed(3))
    if not q.signed:
        x = x.abs()
    x[0, 5], x[1, 290], x[2, 130] = float("nan"), float("inf"), -float("inf") if q.signed else 1e38
    x[2, 131] = float("inf")
    linear = 1 if name == "linear" else (2 if _qstate4.symmetric_signed(q) else 0)
    for codes, absmax in (
        _qstate4.quantize_rows4(x, q, BLOCK),
        _kernel_quantize(x, q, BLOCK, linear),
    ):
        bad = torch.zeros_like(absmax, dtype=torch.bool)
        bad[0, 0] = bad[1, 2] = bad[2, 1] = True
        assert torch.equal(absmax.isnan(), bad), name
        nib = _qstate4.unpack(codes, 301)
        spread = bad.repeat_interleave(BLOCK, dim=1)[:, :301]
        assert bool((nib[spread] == _zero_code(q)).all()), name
        assert bool((codes[1, -1] >> 4) == 0)  # the half byte's empty high nibble stays 0
    ref = _qstate4.quantize_rows4(x, q, BLOCK)
    ker = _kernel_quantize(x, q, BLOCK, linear)
    assert torch.equal(ref[0], ker[0]) and _same_bits(ref[1], ker[1]), name
