"""run_all.py's optimizer-step sections: AdamW8bit and AdamW4bit against torch's fused AdamW, and
a single-GPU GPT training step."""

from __future__ import annotations

import _device as D
from _device import _err, _gbs, _ms, _optimizer_dispatches_to_triton, _route, _Rows
from _harness import Recorder


class _Counted:
    """A Triton kernel whose launches are counted."""

    def __init__(self, kernel) -> None:
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


def adamw4bit(rec: Recorder, args) -> None:
    """The fused 4-bit AdamW step (`AdamW4bit.step()`, which dispatches CUDA parameters to
    `_optim4bit._step4_multi_kernel`) vs torch's fused fp32 AdamW on the same parameters."""
    from unittest import mock

    import torch

    from qshard._triton import _optim4bit
    from qshard.optim import AdamW4bit

    n, rep, row = args.params, args.repeat, 4096
    rows_ = []
    heading = f"AdamW4bit step on {n / 1e6:.0f}M fp32 parameters (vs torch AdamW fused=True)"
    header = ["optimizer", "ms", "x fused fp32", "kernel calls/step", "state bytes/param"]
    g = torch.Generator(device=D.DEVICE).manual_seed(0)
    p32 = torch.randn(n // row, row, device=D.DEVICE, generator=g)
    grad = torch.randn(n // row, row, device=D.DEVICE, generator=g) * 1e-2
    p_ref = torch.nn.Parameter(p32.clone())
    p_ref.grad = grad.clone()
    opt = torch.optim.AdamW([p_ref], lr=1e-3, weight_decay=0.01, fused=D.DEVICE == "cuda")
    t_fused = _ms(opt.step, rep)
    rows_.append(("torch AdamW(fused=True) fp32", f"{t_fused:.3f}", "1.00", "", "8"))
    rec.table(heading, header, rows_)
    del opt, p_ref
    for dtype in (torch.float32, torch.bfloat16):
        try:
            pq = torch.nn.Parameter(p32.clone().to(dtype))
            pq.grad = grad.clone().to(dtype)
            optq = AdamW4bit([pq], lr=1e-3, weight_decay=0.01)
            # the optimizer's launches ([Note: multi-tensor launch]), counted
            kernel = _Counted(_optim4bit._step4_multi_kernel)
            with _route(), mock.patch.object(_optim4bit, "_step4_multi_kernel", kernel):
                optq.step()  # the states and the kept launch exist from here on
                kernel.launches = 0
                t4 = _ms(optq.step, rep)
                calls = kernel.launches / (rep + 2)
            rows_.append(
                (
                    f"qshard AdamW4bit.step() {str(dtype)[6:]} params",
                    f"{t4:.3f}",
                    f"{t4 / t_fused:.2f}",
                    f"{calls:g}",
                    "~1.06",
                )
            )
            del optq, pq
        except Exception as e:
            rows_.append((f"AdamW4bit {dtype}: {_err(e)}", "", "", "", ""))
        rec.table(heading, header, rows_)


def adamw8bit(rec: Recorder, args) -> None:
    import math

    import torch

    from qshard import _triton
    from qshard.quant.dynamic import dynamic_map

    n, rep = args.params, args.repeat
    bs = 256
    p32 = torch.randn(n, device=D.DEVICE)
    grad = torch.randn(n, device=D.DEVICE) * 1e-2
    rows_ = _Rows(
        rec,
        f"AdamW step on {n / 1e6:.0f}M fp32 parameters (target: 8-bit <= 1.0x fused fp32)",
        ["optimizer", "ms", "x fused fp32", "GB/s moved", "state bytes/param"],
    )
    # torch fused fp32 AdamW (the target's baseline).
    p_ref = torch.nn.Parameter(p32.clone())
    p_ref.grad = grad.clone()
    opt = torch.optim.AdamW([p_ref], lr=1e-3, weight_decay=0.01, fused=True)
    t_fused = _ms(opt.step, rep)
    rows_.append(
        (
            "torch AdamW(fused=True) fp32",
            f"{t_fused:.3f}",
            "1.00",
            f"{_gbs(28 * n, t_fused):.0f}",
            "8",
        )
    )
    p_f = torch.nn.Parameter(p32.clone())
    p_f.grad = grad.clone()
    opt_f = torch.optim.AdamW([p_f], lr=1e-3, weight_decay=0.01, foreach=True)
    t_foreach = _ms(opt_f.step, rep)
    rows_.append(
        (
            "torch AdamW(foreach=True) fp32",
            f"{t_foreach:.3f}",
            f"{t_foreach / t_fused:.2f}",
            f"{_gbs(28 * n, t_foreach):.0f}",
            "8",
        )
    )
    del opt, opt_f, p_ref, p_f
    from qshard.optim._qstate import qmap

    code1, code2 = dynamic_map(signed=True).to(D.DEVICE), dynamic_map(signed=False).to(D.DEVICE)
    # The maps' search tables, as AdamW8bit dispatches them (`region`: and the region tables,
    # the gather-free encoder, a second row).
    q1, q2 = qmap(True), qmap(False)
    mid1, mid2 = (code1[:-1] + code1[1:]) / 2, (code2[:-1] + code2[1:]) / 2
    z1, z2 = int((code1 == 0).nonzero()[0]), int((code2 == 0).nonzero()[0])
    p = p32.clone()
    rows, row_numel = n // 4096, 4096
    c1 = torch.full((n,), z1, dtype=torch.uint8, device=D.DEVICE)
    c2 = torch.full((n,), z2, dtype=torch.uint8, device=D.DEVICE)
    a1 = torch.zeros(rows * (row_numel // bs), device=D.DEVICE)
    a2 = torch.zeros_like(a1)
    step = [0]

    def step8(region: bool = False) -> None:
        step[0] += 1
        k = step[0]
        _triton.adam8bit_step(
            param=p,
            grad=grad,
            codes1=c1,
            absmax1=a1,
            code1=code1,
            mid1=mid1,
            zero1=z1,
            signed1=True,
            codes2=c2,
            absmax2=a2,
            code2=code2,
            mid2=mid2,
            zero2=z2,
            signed2=False,
            lut1=q1.lut,
            lut2=q2.lut,
            regions1=q1.regions if region else None,
            regions2=q2.regions if region else None,
            rows=rows,
            row_numel=row_numel,
            block_size=bs,
            hp=[
                1e-3,
                0.9,
                0.999,
                1e-8,
                0.01,
                1e-3 / (1 - 0.9**k),
                math.sqrt(1 - 0.999**k),
                1 - 1e-5,
            ],
            flags=3,
        )

    for label, region in (("", False), (", region encoder", True)):
        t8 = _ms(lambda region=region: step8(region), rep)
        rows_.append(
            (
                f"qshard Triton AdamW8bit step{label}",
                f"{t8:.3f}",
                f"{t8 / t_fused:.2f}",
                f"{_gbs(16 * n + 8 * (n // bs), t8):.0f}",
                "2.03",
            )
        )
    try:
        from qshard.optim import AdamW8bit

        if not _optimizer_dispatches_to_triton():
            raise RuntimeError("qshard.optim has no CUDA dispatch")
        pq = torch.nn.Parameter(p32.clone().view(rows, row_numel))
        pq.grad = grad.view(rows, row_numel).clone()
        optq = AdamW8bit([pq], lr=1e-3, weight_decay=0.01)
        with _route():
            t_opt = _ms(optq.step, rep)
        rows_.append(
            (
                "qshard.optim.AdamW8bit.step() (whole optimizer)",
                f"{t_opt:.3f}",
                f"{t_opt / t_fused:.2f}",
                "",
                "2.03",
            )
        )
    except Exception as e:  # the optimizer's CUDA dispatch may not exist yet
        rows_.append((f"qshard.optim.AdamW8bit.step(): {type(e).__name__}", "", "", "", ""))
    try:
        from qshard.optim import AdamW8bit

        # The fp32-state path (biases, norms, small or optim_bits=32 tensors): torch's own fused
        # kernel through the optimizer, with device copies of its CPU step counters.
        p32s = torch.nn.Parameter(p32.clone())
        p32s.grad = grad.clone()
        opt32 = AdamW8bit([p32s], lr=1e-3, weight_decay=0.01, optim_bits=32, fused=True)
        t_32 = _ms(opt32.step, rep)
        rows_.append(
            (
                "qshard.optim.AdamW8bit(optim_bits=32, fused=True).step()",
                f"{t_32:.3f}",
                f"{t_32 / t_fused:.2f}",
                f"{_gbs(28 * n, t_32):.0f}",
                "8",
            )
        )
        del opt32, p32s
    except Exception as e:
        rows_.append((f"AdamW8bit(optim_bits=32, fused=True): {type(e).__name__}", "", "", "", ""))
    _many_tensors(rec, args)
    _narrow_rows(rec, args)


def _narrow_rows(rec: Recorder, args) -> None:
    """AdamW8bit / AdamW4bit on narrow rows (LoRA's B: one quantization block per row of 8)
    against the same count of parameters in rows of 256 and torch's fused AdamW: the Triton
    kernels take one block of a narrow tensor per padded 256-lane row of a program
    (docs/optim8bit.md, Limits), which the CPU kernels no longer do ([Note: narrow rows]); this
    measures what that costs on the device."""
    import torch

    from qshard.optim import AdamW4bit, AdamW8bit

    numel = 1 << 22 if D.DEVICE == "cuda" else 1 << 12
    rep = args.repeat
    rows_ = _Rows(
        rec,
        f"AdamW step, {numel / 1e6:.1f}M parameters as rows of 8 (LoRA's B) or of 256",
        ["optimizer", "ms", "x fused fp32 (same shape)"],
    )
    gen = torch.Generator(device=D.DEVICE).manual_seed(0)
    base = torch.randn(numel, device=D.DEVICE, generator=gen)
    grad = torch.randn(numel, device=D.DEVICE, generator=gen) * 1e-2
    for width in (8, 256):
        shape = (numel // width, width)

        def param(base=base, grad=grad, shape=shape):
            p = torch.nn.Parameter(base.clone().view(shape))
            p.grad = grad.clone().view(shape)
            return p

        ref = param()
        fused = torch.optim.AdamW([ref], lr=1e-3, weight_decay=0.01, fused=D.DEVICE == "cuda")
        t_fused = _ms(fused.step, rep)
        rows_.append((f"torch AdamW(fused=True) fp32, rows of {width}", f"{t_fused:.3f}", "1.00"))
        del fused, ref
        for cls in (AdamW8bit, AdamW4bit):
            try:
                opt = cls([param()], lr=1e-3, weight_decay=0.01)
                with _route():
                    t = _ms(opt.step, rep)
                rows_.append((f"qshard {cls.__name__}, rows of {width}", f"{t:.3f}",
                              f"{t / t_fused:.2f}"))  # fmt: skip
                del opt
            except Exception as e:
                rows_.append((f"{cls.__name__}, rows of {width}: {_err(e)}", "", ""))


def _many_tensors(rec: Recorder, args) -> None:
    """AdamW8bit on many tensors: one launch for all ([Note: multi-tensor launch]), kept across
    steps ([Note: prepared launch]) or prepared each step, against one launch per tensor (the
    optimizer's dispatch until 2026-12-04) and torch's fused AdamW, whose one multi-tensor
    launch sets the bar."""
    import math

    import torch

    from qshard import _triton
    from qshard.optim import AdamW8bit
    from qshard.optim._qstate import qmap

    count, side = (150, 768) if D.DEVICE == "cuda" else (3, 64)
    rep = args.repeat
    rows_ = _Rows(
        rec,
        f"AdamW step on {count} tensors of {side}x{side} ({count * side * side / 1e6:.0f}M "
        "params): one launch vs one per tensor",
        ["optimizer", "ms", "x fused fp32", "us per tensor"],
    )
    gen = torch.Generator(device=D.DEVICE).manual_seed(0)
    params = [torch.randn(side, side, device=D.DEVICE, generator=gen) for _ in range(count)]
    grads = [torch.randn(side, side, device=D.DEVICE, generator=gen) * 1e-2 for _ in params]

    def fresh():
        ps = [torch.nn.Parameter(p.clone()) for p in params]
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        return ps

    ref = fresh()
    opt = torch.optim.AdamW(ref, lr=1e-3, weight_decay=0.01, fused=D.DEVICE == "cuda")
    t_fused = _ms(opt.step, rep)
    rows_.append(("torch AdamW(fused=True) fp32", f"{t_fused:.3f}", "1.00", f"{t_fused / count * 1e3:.1f}"))  # fmt: skip
    del opt, ref
    try:
        ps = fresh()
        opt8 = AdamW8bit(ps, lr=1e-3, weight_decay=0.01)
        with _route():
            t_one = _ms(opt8.step, rep)
            rows_.append(("qshard.optim.AdamW8bit.step(): one launch, kept", f"{t_one:.3f}",
                          f"{t_one / t_fused:.2f}", f"{t_one / count * 1e3:.1f}"))  # fmt: skip

            def prepared_anew() -> None:  # the dispatch until the launch was kept across steps
                opt8.__dict__.pop("_plan_cache", None)
                opt8.step()

            t_anew = _ms(prepared_anew, rep)
            rows_.append(("AdamW8bit.step(): one launch, prepared each step", f"{t_anew:.3f}",
                          f"{t_anew / t_fused:.2f}", f"{t_anew / count * 1e3:.1f}"))  # fmt: skip
            q1, q2 = qmap(True), qmap(False)
            hp = [1e-3, 0.9, 0.999, 1e-8, 0.01, 1e-3 / 0.1, math.sqrt(1 - 0.999), 1 - 1e-5]

            def per_tensor() -> None:
                for p in ps:
                    st = opt8.state[p]
                    _triton.optim8bit_step(
                        kind="adam", param=p.data, grad=p.grad, codes1=st["exp_avg_codes"],
                        absmax1=st["exp_avg_absmax"], code1=q1.code, mid1=q1.mid,
                        zero1=q1.zero_idx, signed1=True, codes2=st["exp_avg_sq_codes"],
                        absmax2=st["exp_avg_sq_absmax"], code2=q2.code, mid2=q2.mid,
                        zero2=q2.zero_idx, signed2=False, rows=side, row_numel=side,
                        block_size=256, hp=hp, flags=3, lut1=q1.lut, lut2=q2.lut,
                    )  # fmt: skip

            t_each = _ms(per_tensor, rep)
            rows_.append(("one optim8bit_step launch per tensor", f"{t_each:.3f}",
                          f"{t_each / t_fused:.2f}", f"{t_each / count * 1e3:.1f}"))  # fmt: skip
    except Exception as e:
        rows_.append((f"AdamW8bit, {count} tensors: {_err(e)}", "", "", ""))


def _fsdp_units(model) -> list[list]:
    """``model``'s parameters grouped as qshard.train wraps a GPT with ``fully_shard``: one unit
    per transformer block, then the root's (embeddings, final norm, head; a tied head once)."""
    units = [[p for p in block.parameters() if p.requires_grad] for block in model.blocks]
    in_blocks = {id(p) for unit in units for p in unit}
    root = [p for p in model.parameters() if p.requires_grad and id(p) not in in_blocks]
    return [unit for unit in [*units, root] if unit]


def _copy_out(flat, tensors) -> None:
    """FSDP's copy-out: ``flat`` split into ``tensors`` (contiguous, in order), one launch."""
    import torch

    outs = [t.view(-1) for t in tensors]
    torch.split_with_sizes_copy(flat, [t.numel() for t in outs], out=outs)


def _gpt_step_ms(name: str, cfg, data, repeat: int) -> float:
    import torch

    from qshard import _triton
    from qshard.train.model import GPT

    model = GPT(cfg).to(D.DEVICE)
    params = [p for p in model.parameters() if p.requires_grad]
    if name.startswith("fp32"):
        opt = torch.optim.AdamW(params, lr=3e-4, fused=True)
    else:
        from qshard.optim import AdamW8bit

        opt = AdamW8bit(params, lr=3e-4, fused=True)  # fp32-state tensors: the same kernel
    codecs = "codecs" in name
    units = _fsdp_units(model)
    # qgZ's slots of each unit's flat gradient, built once as zeropp builds them: one slot
    # padded to whole wire rows of 4 blocks ([Note: 4-block rows] in zeropp.reduce_scatter).
    offset0 = torch.zeros(1, dtype=torch.int64, device=D.DEVICE)
    slots = []
    for unit in units:
        numel = sum(p.numel() for p in unit)
        slot = -(-numel // 1024) * 1024
        length = torch.full((1,), numel, dtype=torch.int64, device=D.DEVICE)
        slots.append((slot, length, 4 * (slot // 256) + slot // 2))

    def step() -> None:
        # What one rank runs for qwZ (quantize its weights, dequantize the gathered ones) and
        # for qgZ (encode its gradients, decode the reduced ones), without the network: the
        # kernels' cost inside a real training step. Per FSDP unit, as ZeRO++ on FSDP2 runs
        # them: each block's (and the root's) parameters go through one flat buffer (FSDP's
        # copy-in, the codec on the whole buffer, FSDP's copy-out). Per parameter (~150 small
        # tensors, 4 launches each) the row measured Python and launch overhead instead (3.0x
        # fp32 on an H200), a cost no FSDP2 step pays.
        if codecs:
            with torch.no_grad():
                for unit in units:
                    flat = torch.cat([p.data.view(-1) for p in unit])
                    c, s = _triton.quantize_flat(flat, block_size=256, bits=8)
                    _triton.dequantize_blocks(c, s, bits=8, numel=flat.numel(), out=flat)
                    _copy_out(flat, [p.data for p in unit])
        with torch.autocast(D.DEVICE, dtype=torch.bfloat16):
            _, loss = model(data[:, :-1], data[:, 1:])
        loss.backward()
        if codecs:
            with torch.no_grad():
                # The kernels zeropp's reduce-scatter dispatches on CUDA, on its trusted
                # slots (no host-side slot check: the public reorder_quantize's check is two
                # device syncs a call, which this row paid 13 times a step until 2026-12-04).
                for unit, (slot, length, row_bytes) in zip(units, slots):
                    flat = torch.cat([p.grad.view(-1) for p in unit])
                    send = torch.empty((1, row_bytes), dtype=torch.uint8, device=D.DEVICE)
                    _triton.reorder_quantize_rows(
                        flat, offset0, length, slot_numel=slot, block_size=256, bits=4,
                        out=send, check=False,
                    )  # fmt: skip
                    _triton.dequant_reduce_rows(send, block_size=256, bits=4, out=flat)
                    _copy_out(flat, [p.grad for p in unit])
        opt.step()
        opt.zero_grad(set_to_none=False)

    return _ms(step, repeat)


def gpt_step(rec: Recorder, args) -> None:
    import torch

    from qshard.train.model import GPT, GPTConfig

    cfg = GPTConfig(
        vocab_size=256, context=args.context, n_layer=args.layers, n_head=12, n_embd=args.embd
    )
    batch = args.batch
    n_params = GPT(cfg).num_params()
    rows = _Rows(
        rec,
        f"Single-GPU GPT training step ({n_params / 1e6:.0f}M params, {cfg.n_layer}x{cfg.n_embd}, "
        f"batch {batch}x{cfg.context}, bf16 autocast)",
        ["configuration", "ms/step", "x fp32 AdamW", "tokens/s"],
    )
    data = torch.randint(0, 256, (batch, cfg.context + 1), device=D.DEVICE)
    base_ms = None
    for name in (
        "fp32 AdamW(fused)",
        "AdamW8bit",
        "AdamW8bit + qwZ INT8 + qgZ INT4 codecs per FSDP unit",
    ):
        if name != "fp32 AdamW(fused)" and not _optimizer_dispatches_to_triton():
            rows.append((name, "skipped: qshard.optim has no CUDA dispatch", "", ""))
            continue
        ms = _gpt_step_ms(name, cfg, data, max(3, args.repeat // 2))
        base_ms = base_ms or ms
        tokens = batch * cfg.context
        rows.append((name, f"{ms:.1f}", f"{ms / base_ms:.2f}", f"{tokens / (ms * 1e-3):,.0f}"))
        if D.DEVICE == "cuda":
            torch.cuda.empty_cache()
