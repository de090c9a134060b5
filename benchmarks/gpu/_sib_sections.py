"""run_all.py's StepInBackward section: the GPT as one GPU trains it with FSDP2 (qshard's
``shard()`` in a world of one), the optimizer stepped after backward and inside it
(``qshard.zeropp.StepInBackward``), side by side: whether the two left the same parameters, bit
for bit, after the same steps (StepInBackward's first run on CUDA), and the step time.

Not the gradient memory stepping inside backward saves: in a world of one FSDP2 calls no
reduce-scatter, and every unit lands at the end of backward ([Note: step in backward]), so one
device shows no saving by construction; a multi-GPU world would."""

from __future__ import annotations

import _device as D
from _device import _err, _ms, _Rows
from _harness import Recorder


def _trained(opt_name: str, in_backward: bool, cfg, data, repeat: int):
    """(ms per step, the final parameters on CPU)."""
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
    final = [p.detach().full_tensor().float().cpu() for p in params]
    if stepper is not None:
        stepper.close()
    return ms, final


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
        f"params, batch {args.batch}x{cfg.context}, bf16 compute (one device: every unit lands "
        "at the end of backward, so no gradient memory is saved here)",
        ["optimizer", "stepped", "ms/step", "x after backward", "same parameters"],
    )
    dist.init_process_group(  # a world of one: an in-process store, no port
        "nccl" if D.DEVICE == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1
    )
    try:
        data = torch.randint(0, 256, (args.batch, cfg.context + 1), device=D.DEVICE)
        for opt_name in ("torch AdamW(fused)", "AdamW8bit"):
            base = None
            for in_backward in (False, True):
                what = "inside backward" if in_backward else "after backward"
                try:
                    ms, final = _trained(opt_name, in_backward, cfg, data, args.repeat)
                except Exception as e:
                    rows.append((opt_name, f"{what}: {_err(e)}", "", "", ""))
                    continue
                ratio = same = "-"
                if not in_backward:
                    base = (ms, final)
                elif base is not None:
                    ratio = f"{ms / base[0]:.2f}"
                    same = str(all(torch.equal(a, b) for a, b in zip(final, base[1])))
                rows.append((opt_name, what, f"{ms:.1f}", ratio, same))
                if D.DEVICE == "cuda":
                    torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()
