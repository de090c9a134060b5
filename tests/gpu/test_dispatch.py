"""The dispatch hooks in qshard's public functions route to the kernels and change nothing.

Hooks call `qshard._triton.serves(t)`; patching it to accept CPU tensors sends the public
functions through the Triton kernels (in the interpreter here), which must give exactly what
the CPU path gives: quant.blockwise (INT8/INT4, partial blocks, `out=`), zeropp's wire codec,
quant.signs and the 8-bit optimizers.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton", reason="the GPU kernels need triton (pip install qshard[gpu])")

from qshard import _triton
from tests.gpu.conftest import DEVICE, spy_launches
from tests.optim._helpers import replay_plan_changes

pytestmark = pytest.mark.skipif(
    DEVICE.type != "cpu" or os.environ.get("TRITON_INTERPRET") != "1",
    reason="routes CPU tensors through the kernels under the interpreter",
)


class Counter:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, t: torch.Tensor) -> bool:
        self.calls += 1
        return True


def _both(monkeypatch, fn):
    """fn() on the CPU path, then with every hook routed to the kernels.

    The CPU-only C kernels (qshard.quant._native_kernels) run before some hooks and never see a
    CUDA tensor, so the routed run switches them off, as a CUDA tensor would.
    """
    from qshard.quant import _fastpath

    want = fn()
    counter = Counter()
    monkeypatch.setattr(_triton, "serves", counter)
    monkeypatch.setattr(_fastpath, "use_native", lambda t: False)
    monkeypatch.setattr(_fastpath, "use_native_out", lambda t: False)
    got = fn()
    monkeypatch.undo()
    return want, got, counter.calls


def _equal(a, b) -> bool:
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return (
            torch.equal(torch.nan_to_num(a.float(), 1e30), torch.nan_to_num(b.float(), 1e30))
            and a.dtype == b.dtype
        )
    return a == b


def test_available_and_serves():
    assert _triton.available()
    assert not _triton.serves(torch.zeros(1))  # CPU tensors never take the GPU path
    os.environ["QSHARD_DISABLE_TRITON"] = "1"
    try:
        assert not _triton.available()
    finally:
        del os.environ["QSHARD_DISABLE_TRITON"]


@pytest.mark.parametrize(
    ("bits", "numel", "dtype"), [(8, 1000, torch.float32), (4, 777, torch.bfloat16)]
)
def test_blockwise_public_api(monkeypatch, bits, numel, dtype):
    from qshard.quant import blockwise

    x = (torch.randn(numel, generator=torch.Generator().manual_seed(bits)) * 3).to(dtype)
    x[5] = float("nan")

    def run():
        q = blockwise.quantize_blockwise(x, bits=bits, block_size=128)
        y = blockwise.dequantize_blockwise(q, dtype=torch.float32)
        codes, scales = blockwise.quantize_blocks(x[:768].view(6, 128), bits=bits)
        z = blockwise.dequantize_blocks(codes, scales, bits=bits, dtype=torch.bfloat16)
        return (
            q.codes,
            q.scales,
            y,
            codes,
            scales,
            z,
            blockwise.unpack_int4(blockwise.pack_int4(codes)),
        )

    want, got, calls = _both(monkeypatch, run)
    assert calls >= 5
    assert _equal(want, got)


def test_zeropp_wire_codec(monkeypatch):
    from qshard.zeropp._wire import RowCodec

    codec = RowCodec(bits=4, block_size=64)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(0))
    want, got, calls = _both(
        monkeypatch, lambda: (codec.encode(x), codec.decode(codec.encode(x), 256))
    )
    assert calls >= 4
    assert _equal(want, got)


def test_signs(monkeypatch):
    from qshard.quant import signs

    x = torch.randn(1001, generator=torch.Generator().manual_seed(0))
    x[:3] = torch.tensor([0.0, -0.0, float("nan")])
    want, got, calls = _both(
        monkeypatch, lambda: (signs.pack_signs(x), signs.unpack_signs(signs.pack_signs(x), 1001))
    )
    assert calls >= 2
    assert _equal(want, got)


@pytest.mark.parametrize("name", ["AdamW8bit", "SGD8bit"])
def test_optimizer_steps(monkeypatch, name):
    """Three steps through the hook equal the CPU kernel path, with a second parameter whose
    first gradient comes at step 2: then its tensors are a step apart (two hyperparameter
    rows), and SGD's first-step buffer flag differs between them, so SGD's launch is split in
    two (the flag is a constexpr) where Adam's, which does not read it, stays one."""
    from qshard import optim
    from qshard._triton import _optim8bit
    from qshard.optim import _kernels

    if not _kernels.available():
        pytest.skip("qshard.optim's C kernel is not built here")

    def run():
        gen = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((8, 300), (5, 512))]
        kwargs = (
            dict(lr=1e-2, weight_decay=0.01) if name == "AdamW8bit" else dict(lr=0.1, momentum=0.9)
        )
        opt = getattr(optim, name)(ps, block_size=256, min_8bit_size=1024, **kwargs)
        for step in range(3):
            for p in ps[: 1 + (step > 0)]:
                p.grad = torch.randn(p.shape, generator=gen) * 0.1
            opt.step()
        out = []
        for p in ps:
            st = opt.state[p]
            out += [p.detach().clone()]
            out += [st[k].clone() for k in sorted(st) if k.endswith(("_codes", "_absmax"))]
        return out

    launches = spy_launches(monkeypatch, _optim8bit, "_step8_multi_kernel")
    want, got, calls = _both(monkeypatch, run)
    assert calls >= 2
    assert _equal(want, got)
    tensors = [args[2] for _, args, _ in launches]  # a launch's tensors, step by step
    assert tensors == ([1, 1, 1, 2] if name == "SGD8bit" else [1, 2, 2]), tensors


def test_optimizer_steps_many_tensors_in_one_launch_per_dtype(monkeypatch):
    """A group of fp32 and bf16 parameters of odd shapes (and an fp16 gradient): two steps on
    the kernels, one launch per parameter dtype a step ([Note: multi-tensor launch]), equal to
    the CPU path (the C kernel for fp32; the torch reference for bf16, see below). Each tensor
    of the launch against its own one-tensor launch, bit for bit: test_optim8bit."""
    from qshard import optim
    from qshard._triton import _optim8bit
    from qshard.optim import _kernels

    if not _kernels.available():
        pytest.skip("qshard.optim's C kernel is not built here")
    shapes = [((8, 300), torch.float32), ((40, 64), torch.float32), ((3, 1000), torch.bfloat16),
              ((17, 77), torch.float32), ((5, 512), torch.bfloat16)]  # fmt: skip

    def run():
        gen = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dt)) for s, dt in shapes]
        ps[3].grad_dtype = None  # (torch >= 2.10 refuses a gradient of another dtype otherwise)
        opt = optim.AdamW8bit(ps, lr=1e-2, weight_decay=0.01, block_size=256, min_8bit_size=1024)
        for _ in range(2):
            for i, p in enumerate(ps):
                g = torch.randn(p.shape, generator=gen) * 0.1
                p.grad = g.half() if i == 3 else g.to(p.dtype)  # fp16: the kernel reads fp32
            opt.step()
        out = []
        for p in ps:
            st = opt.state[p]
            out += [p.detach().clone()] + [st[k].clone() for k in sorted(st) if "_" in k]
        return out

    launches = spy_launches(monkeypatch, _optim8bit, "_step8_multi_kernel")
    want, got, _ = _both(monkeypatch, run)  # (the CPU run launches nothing)
    # (parameter dtype bf16?, tensors): one launch per dtype a step, the fp16 gradient as fp32
    assert [(kw["P_BF16"], args[2]) for _, args, kw in launches] == [(False, 3), (True, 2)] * 2
    # fp32 parameters: bit for bit (the C kernel is the kernel's twin). bf16 ones take the torch
    # reference on CPU, whose first moment is torch's lerp (torch.optim's rounding), not the
    # kernel's m + (1 - b1) * (g - m): same codes, absmax within an ulp or two.
    for k, (w, g) in enumerate(zip(want, got)):
        if shapes[k // 5][1] == torch.float32:
            assert _equal(w, g), k
        else:
            assert w.dtype == g.dtype and torch.allclose(w.float(), g.float(), rtol=1e-6, atol=0), k


@pytest.mark.parametrize("name", ["AdamW8bit", "AdamW4bit"])
def test_prepared_launches_kept_only_while_their_tensors_are(monkeypatch, name):
    """[Note: prepared launch]: the optimizers keep a group's checked launch across steps while
    its tensors are the same, pointing it at each step's gradients, and prepare again when a
    parameter's data or the states were replaced or a gradient is off 16-byte alignment; a
    changed block size is refused as before, not run on the old layout. Every step equals the
    CPU path (the C kernels), bit for bit: a launch still reading an old gradient would not."""
    from qshard import optim
    from qshard.optim import _kernels, _kernels4

    if not (_kernels.available() and _kernels4.available()):
        pytest.skip("qshard.optim's C kernels are not built here")
    prepare_name = "prepare_optim8bit_multi" if name == "AdamW8bit" else "prepare_optim4bit_multi"
    prepared = []

    def run():
        gen = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((8, 300), (40, 64))]
        small = dict(min_8bit_size=1024) if name == "AdamW8bit" else dict(min_4bit_size=1024)
        opt = getattr(optim, name)(ps, lr=1e-2, weight_decay=0.01, block_size=256, **small)
        return replay_plan_changes(opt, ps, gen, lambda: len(prepared))

    real = getattr(_triton, prepare_name)

    def counted(**kw):
        prepared.append(len(kw["params"]))
        return real(**kw)

    monkeypatch.setattr(_triton, prepare_name, counted)
    (_, want), (counts, got), _ = _both(monkeypatch, run)
    assert counts == [1, 1, 1, 1, 2, 3, 4, 5, 5, 6, 7], counts  # (the CPU run prepares nothing)
    assert _equal(want, got)


@pytest.mark.parametrize("name", ["AdamW8bit", "AdamW4bit"])
@pytest.mark.parametrize("order", [("bf16", "fp32"), ("fp32", "bf16")])
def test_a_kept_launch_follows_a_gradient_whose_dtype_changes(monkeypatch, name, order):
    # With p.grad_dtype = None (torch >= 2.10) an fp32 parameter may get a bf16 gradient one
    # step and an fp32 one the next; the kept launch ([Note: prepared launch]) read the new
    # gradient as the old dtype (NaN parameters; on a GPU an out-of-bounds read).
    from qshard import optim

    if not hasattr(torch.nn.Parameter(torch.zeros(1)), "grad_dtype"):
        pytest.skip("this torch has no Parameter.grad_dtype")
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}

    def run(kernel: bool) -> torch.Tensor:
        monkeypatch.setattr(_triton, "serves", lambda t: kernel)
        gen = torch.Generator().manual_seed(0)
        p = torch.nn.Parameter(torch.randn(8, 512, generator=gen))
        p.grad_dtype = None
        small = dict(min_8bit_size=1) if "8bit" in name else dict(min_4bit_size=1)
        opt = getattr(optim, name)([p], lr=1e-2, **small)
        for dt in (*order, order[0]):
            p.grad = (torch.randn(p.shape, generator=gen) * 0.1).to(dtypes[dt])
            opt.step()
        return p.detach().clone()

    got, want = run(True), run(False)
    assert not got.isnan().any() and torch.equal(got, want)
