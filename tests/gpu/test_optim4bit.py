"""The fused 4-bit Adam/AdamW Triton kernel vs the torch reference
`qshard.optim._qstate4.adam4bit_reference` (and so the CPU kernel), bit for bit: Adam, AdamW and
no decay, every second-moment map, rows with partial blocks and odd lengths, bf16 parameters;
and `AdamW4bit` dispatching CUDA tensors to it (CPU tensors routed through the hook under the
interpreter).
Under TRITON_INTERPRET=1 on a machine without a GPU (tests/gpu/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the GPU kernels need triton (pip install qshard[gpu])")

from qshard import _triton
from qshard.optim import _qstate4
from qshard.optim.adam4bit import AdamW4bit
from tests.gpu.conftest import DEVICE, spy_launches

_HP = [
    dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True),
    dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, decoupled=False),
    dict(lr=3e-3, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.0, decoupled=True),
]
# (rows, row_numel, block): partial last block, odd rows (half a byte), a tail shorter than
# the tile, one block per row.
_SHAPES = [(5, 300, 128), (3, 129, 128), (4, 13, 2), (2, 256, 256)]


def _warm_state(shape, block, v_map, gen, device):
    """Moments from a few torch-reference steps (realistic codes and absmaxes)."""
    rows, row_numel = shape
    m = torch.randn(rows, row_numel, generator=gen) * 0.1
    v = torch.rand(rows, row_numel, generator=gen).pow(4) * 0.01
    m[:1, :5] = 0.0
    v[:1, :5] = 0.0
    mc, ma = _qstate4.quantize_rows4(m, _qstate4.qmap4("signed-dynamic"), block)
    vc, va = _qstate4.quantize_rows4(v, _qstate4.qmap4(v_map), block)
    return [t.to(device) for t in (mc, ma, vc, va)]


def _assert_same_bits(got, want, where) -> None:
    """Each kernel output equals its reference bit for bit (floats compared as their bits)."""
    for k, r in zip(got, want, strict=True):
        k = k.cpu()
        if k.is_floating_point():
            bits = {2: torch.int16, 4: torch.int32}[k.element_size()]
            k, r = k.view(bits), r.view(bits)
        assert torch.equal(k, r), where


def _kernel_and_reference(p, g, state, qm, qv, block, hp, device, **luts):
    """One step of the Triton kernel on ``device`` and of the torch reference on the CPU, from
    the same parameter ``p`` (rows of dim 0), gradient and state (codes and absmax of m and v):
    (kernel param, kernel state, reference param, reference state)."""
    rows, row_numel = p.shape
    ref_p, ref_state = p.clone(), [t.clone() for t in state]
    _qstate4.adam4bit_reference(ref_p, g, *ref_state, m_map=qm, v_map=qv, block_size=block, hp=hp)
    kp, ks = p.to(device), [t.to(device) for t in state]
    _triton.optim4bit_step(
        param=kp,
        grad=g.to(device),
        m_codes=ks[0],
        m_absmax=ks[1],
        m_code=qm.code,
        m_mid=qm.mid,
        v_codes=ks[2],
        v_absmax=ks[3],
        v_code=qv.code,
        v_mid=qv.mid,
        rows=rows,
        row_numel=row_numel,
        block_size=block,
        hp=hp,
        **luts,
    )
    return kp, ks, ref_p, ref_state


@pytest.mark.parametrize("lut", [True, False], ids=["table", "binary"])
@pytest.mark.parametrize("v_map", _qstate4.SECOND_MOMENT_MAPS)
@pytest.mark.parametrize("hp_case", range(len(_HP)))
def test_kernel_equals_torch_reference(device, v_map, hp_case, lut):
    """Both encoders (the maps' search tables, the midpoints' binary search) bit for bit."""
    gen = torch.Generator().manual_seed(hp_case)
    qm, qv = _qstate4.qmap4("signed-dynamic"), _qstate4.qmap4(v_map)
    for rows, row_numel, block in _SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            p = torch.randn(rows, row_numel, generator=gen).to(dtype)
            g = torch.randn(rows, row_numel, generator=gen) * 0.3
            g[0, :3] = -0.0
            g = g.to(dtype)
            state = _warm_state((rows, row_numel), block, v_map, gen, "cpu")
            hp = _qstate4.adam_hparams(step=3, **_HP[hp_case])
            luts = {"m_lut": qm.lut, "v_lut": qv.lut} if lut else {}
            kp, ks, ref_p, ref_state = _kernel_and_reference(
                p, g, state, qm, qv, block, hp, device, **luts
            )
            where = (v_map, hp_case, rows, row_numel, block, dtype)
            _assert_same_bits([kp, *ks], [ref_p, *ref_state], where)


def test_bad_arguments_are_rejected(device):
    qm = _qstate4.qmap4("linear")
    z = torch.zeros(2, 8, device=device)
    c = torch.zeros(2, 4, dtype=torch.uint8, device=device)
    a = torch.zeros(2, 1, device=device)
    common = dict(param=z, grad=z, m_codes=c, m_absmax=a, m_code=qm.code, m_mid=qm.mid)
    common.update(v_codes=c, v_absmax=a, v_code=qm.code, v_mid=qm.mid, rows=2, row_numel=8)
    hp = _qstate4.adam_hparams(step=1, **_HP[0])
    with pytest.raises(ValueError, match="even"):
        _triton.optim4bit_step(**common, block_size=7, hp=hp)
    with pytest.raises(ValueError, match="m_codes"):
        _triton.optim4bit_step(**{**common, "m_codes": c[:, :3].contiguous()}, block_size=8, hp=hp)
    # v's midpoints were not checked (m's were): the search reads 15 of them unmasked.
    with pytest.raises(ValueError, match="v_mid: expected >= 15"):
        _triton.optim4bit_step(**{**common, "v_mid": qm.mid[:7]}, block_size=8, hp=hp)
    with pytest.raises(ValueError, match="m_lut: expected the int32"):
        _triton.optim4bit_step(**common, block_size=8, hp=hp, m_lut=qm.lut[:100])


def test_adamw4bit_dispatches_to_the_kernel(monkeypatch):
    """Two AdamW4bit steps through the kernel equal the CPU path (C kernel or torch reference:
    bit-identical to each other). On CUDA the second run's parameter is a CUDA tensor, which the
    optimizer hands to the compiled kernel by itself; under the interpreter it stays on CPU and
    `_triton.serves` is patched to route it there. Either way every launch of the kernel is
    counted, and the results are compared on CPU."""
    if not _triton.interpreter() and not torch.cuda.is_available():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    from qshard._triton import _optim4bit

    def run(device):
        gen = torch.Generator().manual_seed(0)
        p = torch.nn.Parameter(torch.randn(8, 300, generator=gen).to(device))
        opt = AdamW4bit([p], lr=1e-2, weight_decay=0.1, min_4bit_size=1024)
        for _ in range(2):
            p.grad = (torch.randn(8, 300, generator=gen) * 0.1).to(device)
            opt.step()
        state = {k: v.cpu() for k, v in sorted(opt.state[p].items())}
        return {"param": p.detach().cpu(), **state}

    want = run("cpu")
    # one launch a step ([Note: multi-tensor launch]), its table on the parameter's device
    launches = spy_launches(monkeypatch, _optim4bit, "_step4_multi_kernel")
    if DEVICE.type == "cpu":
        monkeypatch.setattr(_triton, "serves", lambda t: True)
    got = run(DEVICE)
    monkeypatch.undo()
    devices = [args[0].device.type for _, args, _ in launches]
    assert devices == [DEVICE.type] * 2, devices
    assert got.keys() == want.keys()
    for k in want:
        assert want[k].dtype == got[k].dtype and torch.equal(want[k], got[k]), k


@pytest.mark.parametrize("v_map", _qstate4.SECOND_MOMENT_MAPS)
def test_blocks_whose_reciprocal_overflows_equal_the_reference(device, v_map):
    """[Note: 4-bit normalisation] in qshard.optim._kernels4: blocks whose new absmax is
    subnormal (the fp32 reciprocal overflows) are divided, as on the torch reference and the C
    kernel, bit for bit (on a device that flushes subnormals this would not hold: not run on one
    yet)."""
    gen = torch.Generator().manual_seed(11)
    qm, qv = _qstate4.qmap4("signed-dynamic"), _qstate4.qmap4(v_map)
    rows, row_numel, block = 6, 40, 8
    p = torch.randn(rows, row_numel, generator=gen)
    g = torch.randn(rows, row_numel, generator=gen) * 0.3
    for row, scale in ((0, 1e-21), (1, 1e-39), (2, 1e-41), (3, 1e-44)):
        g[row] *= scale
    m = torch.randn(rows, row_numel, generator=gen) * 1e-40
    v = torch.rand(rows, row_numel, generator=gen) * 1e-44
    state = [*_qstate4.quantize_rows4(m, qm, block), *_qstate4.quantize_rows4(v, qv, block)]
    assert bool((state[1] < 2.0**-126).any()), "the test needs subnormal absmaxes"
    hp = _qstate4.adam_hparams(step=3, **_HP[0])
    kp, ks, ref_p, ref_state = _kernel_and_reference(p, g, state, qm, qv, block, hp, device)
    _assert_same_bits([kp, *ks], [ref_p, *ref_state], v_map)


@pytest.mark.parametrize("v_map", _qstate4.SECOND_MOMENT_MAPS)
def test_nonfinite_blocks_store_nan_absmax_as_the_reference(device, v_map):
    """NaN, Inf and -Inf gradients (tests/optim/test_4bit_nonfinite.py's contract): the blocks of
    m and v holding them get a NaN absmax and the code of 0.0, as on the torch reference and so
    the C kernel; everything else bit for bit; the poisoned parameters non-finite."""
    gen = torch.Generator().manual_seed(7)
    qm, qv = _qstate4.qmap4("signed-dynamic"), _qstate4.qmap4(v_map)
    rows, row_numel, block = 3, 301, 128  # 3 blocks a row, the last partial and odd
    for hp_case in (0, 1):
        p = torch.randn(rows, row_numel, generator=gen)
        g = torch.randn(rows, row_numel, generator=gen) * 0.3
        g[0, 5], g[1, 290], g[2, 130] = float("nan"), float("inf"), -float("inf")
        state = _warm_state((rows, row_numel), block, v_map, gen, "cpu")
        hp = _qstate4.adam_hparams(step=3, **_HP[hp_case])
        kp, ks, ref_p, ref_state = _kernel_and_reference(p, g, state, qm, qv, block, hp, device)
        bad = torch.zeros(rows, 3, dtype=torch.bool)
        bad[0, 0] = bad[1, 2] = bad[2, 1] = True
        kp = kp.cpu()
        assert torch.equal(kp.isnan(), ref_p.isnan()), (v_map, hp_case)
        fin = ~kp.isnan()
        assert torch.equal(kp[fin].view(torch.int32), ref_p[fin].view(torch.int32))
        assert not bool(kp[0, 5].isfinite() or kp[1, 290].isfinite() or kp[2, 130].isfinite())
        for i, (k, r) in enumerate(zip(ks, ref_state)):
            k = k.cpu()
            if k.dtype == torch.float32:  # an absmax: NaN exactly on the poisoned blocks
                assert torch.equal(k.isnan(), bad) and torch.equal(r.isnan(), bad), (v_map, i)
                k, r = k[~bad], r[~bad]
            assert torch.equal(k, r), (v_map, hp_case, i)


@pytest.mark.parametrize("v_map", _qstate4.SECOND_MOMENT_MAPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_multi_tensor_launch_equals_the_reference_per_tensor(device, v_map, dtype):
    """Six tensors of odd shapes (an empty one, a single element, odd rows) in one launch
    ([Note: multi-tensor launch]), each at its own step: each equals the torch reference (and so
    its own one-tensor launch) bit for bit."""
    gen = torch.Generator().manual_seed(7)
    qm, qv = _qstate4.qmap4("signed-dynamic"), _qstate4.qmap4(v_map)
    block = 128
    shapes = [(5, 300), (3, 129), (0, 64), (1, 1), (2, 256), (7, 77)]
    want, args = [], {k: [] for k in ("params", "grads", "layouts", "m_codes", "m_absmax",
                                      "v_codes", "v_absmax", "hps")}  # fmt: skip
    for i, (rows, row_numel) in enumerate(shapes):
        p = torch.randn(rows, row_numel, generator=gen).to(dtype)
        g = (torch.randn(rows, row_numel, generator=gen) * 0.3).to(dtype)
        hp = _qstate4.adam_hparams(step=2 + i, **_HP[i % len(_HP)])
        if rows == 0:  # an empty shard: nothing to step (the reference takes no empty rows)
            packed = _qstate4.packed_row(row_numel)
            nbr = -(-row_numel // block)
            state = [torch.empty(0, packed, dtype=torch.uint8), torch.empty(0, nbr)] * 2
            ref_p, ref_state = p.clone(), [t.clone() for t in state]
        else:
            state = _warm_state((rows, row_numel), block, v_map, gen, "cpu")
            ref_p, ref_state = p.clone(), [t.clone() for t in state]
            _qstate4.adam4bit_reference(
                ref_p, g, *ref_state, m_map=qm, v_map=qv, block_size=block, hp=hp
            )
        want.append((ref_p, ref_state))
        ks = [t.to(device) for t in state]
        for k, v in zip(("params", "grads", "layouts", "m_codes", "m_absmax", "v_codes",
                         "v_absmax", "hps"),
                        (p.to(device), g.to(device), (rows, row_numel), *ks, hp)):  # fmt: skip
            args[k].append(v)
    _triton.optim4bit_step_multi(
        **args, m_code=qm.code, m_mid=qm.mid, v_code=qv.code, v_mid=qv.mid, block_size=block,
        m_lut=qm.lut, v_lut=qv.lut,
    )  # fmt: skip
    for i, (ref_p, ref_state) in enumerate(want):
        got = [args[k][i] for k in ("params", "m_codes", "m_absmax", "v_codes", "v_absmax")]
        _assert_same_bits(got, [ref_p, *ref_state], i)


def test_multi_tensor_launch_rejects_bad_lists(device):
    qm = _qstate4.qmap4("linear")
    z = torch.zeros(2, 8, device=device)
    c = torch.zeros(2, 4, dtype=torch.uint8, device=device)
    a = torch.zeros(2, 1, device=device)
    hp = _qstate4.adam_hparams(step=1, **_HP[0])
    common = dict(layouts=[(2, 8)] * 2, m_absmax=[a, a], v_codes=[c, c], v_absmax=[a, a],
                  m_code=qm.code, m_mid=qm.mid, v_code=qm.code, v_mid=qm.mid, block_size=8,
                  hps=[hp, hp])  # fmt: skip
    with pytest.raises(ValueError, match="m_codes has 1 entries for 2 params"):
        _triton.optim4bit_step_multi(params=[z, z], grads=[z, z], m_codes=[c], **common)
    with pytest.raises(ValueError, match=r"m_codes\[1\]: expected 8 elements"):
        _triton.optim4bit_step_multi(
            params=[z, z], grads=[z, z], m_codes=[c, c[:, :3].contiguous()], **common
        )
    with pytest.raises(ValueError, match="split the list by dtype"):
        _triton.optim4bit_step_multi(
            params=[z, z.bfloat16()], grads=[z, z], m_codes=[c, c], **common
        )


def test_adamw4bit_launches_once_per_dtype_for_many_tensors(monkeypatch):
    """Five fp32 / bf16 parameters of odd shapes: one launch per parameter dtype a step, equal
    to the CPU path (C kernel and torch reference: bit-identical to each other)."""
    if not _triton.interpreter() and not torch.cuda.is_available():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    from qshard._triton import _optim4bit

    shapes = [((8, 300), torch.float32), ((3, 1000), torch.bfloat16), ((40, 64), torch.float32),
              ((17, 77), torch.float32), ((5, 512), torch.bfloat16)]  # fmt: skip

    def run(device):
        gen = torch.Generator().manual_seed(0)
        ps = [
            torch.nn.Parameter(torch.randn(s, generator=gen).to(dt).to(device)) for s, dt in shapes
        ]
        opt = AdamW4bit(ps, lr=1e-2, weight_decay=0.1, min_4bit_size=1024)
        for _ in range(2):
            for p in ps:
                p.grad = (torch.randn(p.shape, generator=gen) * 0.1).to(p.dtype).to(device)
            opt.step()
        return [
            t.cpu() for p in ps for t in (p.detach(), *(v for _, v in sorted(opt.state[p].items())))
        ]

    want = run("cpu")
    launches = spy_launches(monkeypatch, _optim4bit, "_step4_multi_kernel")
    if DEVICE.type == "cpu":
        monkeypatch.setattr(_triton, "serves", lambda t: True)
    got = run(DEVICE)
    monkeypatch.undo()
    # (parameter dtype bf16?, tensors): one launch per dtype a step
    assert [(kw["P_BF16"], args[2]) for _, args, kw in launches] == [(False, 3), (True, 2)] * 2
    assert len(got) == len(want)
    for k, (w, g) in enumerate(zip(want, got)):
        assert w.dtype == g.dtype and torch.equal(w, g), k
