"""4-bit Adam/AdamW on FSDP2-sharded parameters: sharded == unsharded step by step (bit for bit,
params and every state tensor, on 4 and 2 ranks with uneven and empty shards), and a DCP
checkpoint saved on 4 ranks loads on 2 ranks and then on 1 process with the very same state.

Gradients are set explicitly (the same global gradient on every rank, distributed like the
parameter), so the comparison isolates the optimizer: with the row-block layout the sharded
step runs the unsharded per-block arithmetic on whole rows (whole bytes of packed codes).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from qshard.optim import Adam4bit, AdamW4bit
from qshard.testing import run_world

_KW = {"min_4bit_size": 1024}
_STEPS = 3


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(48, 300)  # weight (300, 48): one partial block per row
        self.l2 = nn.Linear(301, 70)  # weight (70, 301): 2 x 128 + 45 (odd: half a byte)
        self.l3 = nn.Linear(70, 5)  # 350 elements: fp32 state; 5 rows -> an empty shard on 4
        self.pad = nn.Linear(300, 301, bias=False)  # (301, 300): 301 rows, uneven shards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l3(torch.tanh(self.l2(self.pad(torch.tanh(self.l1(x))))))


def _build(seed: int = 0) -> _Net:
    torch.manual_seed(seed)
    return _Net()


def _groups(model: nn.Module) -> list[dict]:
    # l1.weight gets fp32 state through its param group; the rest uses the defaults.
    named = dict(model.named_parameters())
    return [
        {"params": [p for n, p in named.items() if n != "l1.weight"]},
        {"params": [named["l1.weight"]], "optim_bits": 32},
    ]


def _shard(model: nn.Module, mesh) -> nn.Module:
    for m in (model.l1, model.pad, model.l2, model.l3):
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _set_grads(sharded: nn.Module, ref: nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(1000 + step)
    ref_params = dict(ref.named_parameters())
    for name, p in sharded.named_parameters():
        g = torch.randn(p.shape, generator=gen) * (0.1 + step)
        g[..., :3] = -0.0
        ref_params[name].grad = g.clone()
        p.grad = distribute_tensor(g, p.device_mesh, p.placements)


def _compare(opt_s, opt_r, model_s, model_r, where: str) -> None:
    for (name, p), pr in zip(model_s.named_parameters(), model_r.parameters()):
        assert torch.equal(_full(p.detach()), pr.detach()), f"{where}: param {name} differs"
        st, sr = opt_s.state[p], opt_r.state[pr]
        assert sorted(st) == sorted(sr), (name, sorted(st), sorted(sr))
        for k in st:
            assert torch.equal(_full(st[k]), sr[k]), f"{where}: state {name}.{k} differs"


def _sharded_equals_unsharded(rank: int, world_size: int, mesh) -> None:
    for cls, kw in ((AdamW4bit, dict(lr=1e-2, weight_decay=0.1)), (Adam4bit, dict(lr=1e-2))):
        ref = _build()
        model = _shard(_build(), mesh)
        opt_r, opt_s = cls(_groups(ref), **kw, **_KW), cls(_groups(model), **kw, **_KW)
        for step in range(_STEPS):
            _set_grads(model, ref, step)
            opt_r.step()
            opt_s.step()
            _compare(opt_s, opt_r, model, ref, f"{cls.__name__} ws={world_size} step {step}")
        kinds = {
            n: "4bit" if "exp_avg_codes" in opt_s.state[p] else "32bit"
            for n, p in model.named_parameters()
        }
        assert kinds == {
            "l1.weight": "32bit",
            "l1.bias": "32bit",
            "l2.weight": "4bit",
            "l2.bias": "32bit",
            "l3.weight": "32bit",
            "l3.bias": "32bit",
            "pad.weight": "4bit",
        }, kinds
        codes = opt_s.state[model.l2.weight]["exp_avg_codes"]
        assert isinstance(codes, DTensor) and codes.shape == (70, 151)


def _world(rank: int, world_size: int, ckpt: str) -> None:
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world_size,))
    _sharded_equals_unsharded(rank, world_size, mesh)

    model = _shard(_build(), mesh)
    opt = AdamW4bit(_groups(model), lr=1e-2, weight_decay=0.1, **_KW)
    if world_size == 4:  # save after a few steps
        ref = _build()
        for step in range(_STEPS):
            _set_grads(model, ref, step)
            opt.step()
        dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=ckpt)
        expected = {
            n: {k: _full(v).clone() for k, v in opt.state[p].items()}
            for n, p in model.named_parameters()
        }
        if rank == 0:
            torch.save(expected, os.path.join(ckpt, "expected.pt"))
        dist.barrier()
    else:  # 2 ranks load the 4-rank checkpoint: the very same state
        dist.barrier()
        expected = torch.load(os.path.join(ckpt, "expected.pt"))
        osd = get_optimizer_state_dict(model, opt)  # initialises the state layout (lr-0 step)
        dcp.load({"optim": osd}, checkpoint_id=ckpt)
        set_optimizer_state_dict(model, opt, osd)
        for n, p in model.named_parameters():
            st = opt.state[p]
            assert sorted(st) == sorted(expected[n]), n
            for k, v in st.items():
                assert torch.equal(_full(v), expected[n][k]), f"{n}.{k}"
                assert v.dtype == expected[n][k].dtype, f"{n}.{k}: {v.dtype}"
        assert [g["optim_bits"] for g in opt.param_groups] == [4, 32]


def test_fsdp_sharded_equals_unsharded_and_dcp_reshard(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    os.makedirs(ckpt)
    run_world(_world, 4, args=(ckpt,), timeout_s=240)
    run_world(_world, 2, args=(ckpt,), timeout_s=180)

    # 1 process, no process group, unsharded model: the same state again, and it trains on.
    expected = torch.load(os.path.join(ckpt, "expected.pt"))
    model = _build()
    opt = AdamW4bit(_groups(model), lr=1e-2, weight_decay=0.1, **_KW)
    osd = get_optimizer_state_dict(model, opt)
    dcp.load({"optim": osd}, checkpoint_id=ckpt, no_dist=True)
    set_optimizer_state_dict(model, opt, osd)
    for n, p in model.named_parameters():
        for k, v in opt.state[p].items():
            assert torch.equal(v, expected[n][k]), f"{n}.{k}"
            assert v.dtype == expected[n][k].dtype
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    assert int(opt.state[model.l2.weight]["step"]) == _STEPS + 1


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-x", "-q"])
