"""run_all.py's StepInBackward section: the GPT as one GPU trains it with FSDP2 (qshard's
``shard()`` in a world of one), the optimizer stepped after backward and inside it
(``qshard.zeropp.StepInBackward``), side by side: the peak memory of a step (what stepping
inside backward is for: each unit's gradient is freed as soon as it is stepped), the step time,
and whether the two left the same parameters, bit for bit, after the same steps."""

from __future__ import annotations

import socket

import _device as D
from _device import _err, _ms, _Rows
from _harness import Recorder


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trained(opt_name: str, in_backward: bool, cfg, data, repeat: int):
    """(ms per step, peak bytes of one step or None off CUDA, the final parameters on CPU)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from qshard.comm import Topology
    from qshard.optim import AdamW8bit
    from qshard.train.model import GPT
    from qshard.zeropp import StepInBackward, ZeroPPConfig, shard

    torch.manual_seed(0)
    model = GPT(cfg).to(D.DEVICE)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # (the plain wire through the overlap queue, whose landing StepInBackward steps on)
    shard(
        model,
        topology=Topology.from_env(ranks_per_node=1),
        config=ZeroPPConfig(overlap_reduce_scatter=True),
        mp_policy=policy,
    )
    params = list(model.parameters())
    if opt_name == "AdamW8bit":
        opt = AdamW8bit(params, lr=3e-4)
    else:
        opt = torch.optim.AdamW(params, lr=3e-4, fused=D.DEVICE == "cuda")
    stepper = StepInBackward(model, opt) if in_backward else None

    def step() -> None:
        _, loss = model(data[:, :-1], data[:, 1:])
        loss.backward()
        if stepper is None:
            opt.step()
            opt.zero_grad(set_to_none=True)

    ms = _ms(step, repeat)  # warm-up steps included: both modes run the same steps
    peak = None
    if D.DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        step()
    final = [p.detach().full_tensor().float().cpu() for p in params]
    if stepper is not None:
        stepper.close()
    return ms, peak, final


def step_in_backward(rec: Recorder, args) -> None:
    import torch
    import torch.distributed as dist

    from qshard.train.model import GPT, GPTConfig

    cfg = GPTConfig(
        vocab_size=256, context=args.context, n_layer=args.layers, n_head=12, n_embd=args.embd
    )
    n_params = GPT(cfg).num_params()
    rows = _Rows(
        rec,
        f"StepInBackward on one device: FSDP2 (shard(), a world of one), GPT {n_params / 1e6:.0f}M "
        f"params, batch {args.batch}x{cfg.context}, bf16 compute (peak: one step's "
        "torch.cuda.max_memory_allocated)",
        ["optimizer", "stepped", "ms/step", "peak MiB", "peak x after-backward", "same parameters"],
    )
    dist.init_process_group(
        "nccl" if D.DEVICE == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{_free_port()}",
        rank=0,
        world_size=1,
    )
    try:
        data = torch.randint(0, 256, (args.batch, cfg.context + 1), device=D.DEVICE)
        for opt_name in ("torch AdamW(fused)", "AdamW8bit"):
            base = None
            for in_backward in (False, True):
                what = "inside backward" if in_backward else "after backward"
                try:
                    ms, peak, final = _trained(opt_name, in_backward, cfg, data, args.repeat)
                except Exception as e:
                    rows.append((opt_name, f"{what}: {_err(e)}", "", "", "", ""))
                    continue
                if base is None and not in_backward:
                    base = (peak, final)
                mib = "-" if peak is None else f"{peak / 2**20:,.0f}"
                ratio = same = "-"
                if in_backward and base is not None:
                    if peak is not None and base[0]:
                        ratio = f"{peak / base[0]:.2f}"
                    same = str(all(torch.equal(a, b) for a, b in zip(final, base[1])))
                rows.append((opt_name, what, f"{ms:.1f}", mib, ratio, same))
                if D.DEVICE == "cuda":
                    torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()
