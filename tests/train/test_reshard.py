"""Checkpoints resume on another number of ranks (elastic restarts) and continue correctly.

A chain of worlds, each loading what the previous one saved: 2 ranks -> 1 -> 2 (FSDP2 ZeRO-3,
bf16 mixed precision) by default; 2 -> 4 (FSDP -> HSDP 2 nodes x 2), and 4 (2 nodes x 2:
ZeRO++ all features, HSDP) -> 2 (1 node x 2: FSDP, HSDP) marked slow. The model has odd
parameter sizes: 37 rows (not divisible by 2 or 4), 3 rows (fewer than 4 ranks), 1 row, and a
1-element parameter; 8- and 4-bit state covers all its matrices (block size 16: partial blocks).

The reference for torch AdamW, AdamW8bit and AdamW4bit: after the load, the global state
(parameters and every optimizer state tensor, codes and absmax included) equals the saved one bit
for bit, and one step with the same global gradients on the new world equals, bit for bit, both
the original world's own next step and a plain unsharded single-process optimizer loaded with
the saved global state (the row-block layout runs the unsharded arithmetic on every shard, so no
tolerance is needed). The gradients are given (the same global tensors on every world) so that
the comparison is of the optimizer and the checkpoint, not of the reduction order.

The per-rank optimizers (OneBitAdam, ZeroOneAdam, per-rank checkpoints): on another number of
ranks every rank loads a saved rank's file (rank 0's; on HSDP node 0's rank of the same local
rank), everything but the error buffers as saved, the error buffers restart from zero with a
warning that says so, and training continues. A DCP checkpoint of theirs (``per_rank=False``)
is refused on another world with an error naming the world sizes and the per-rank checkpoints,
before anything is loaded.
"""

from __future__ import annotations

import warnings
import zlib
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from qshard.testing import run_world

V = 37
DCP_OPTIMS = ("adamw", "8bit", "4bit")
PER_RANK_OPTIMS = ("onebit", "zeroone")


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(24, 24)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.fc(h))


class _Odd(nn.Module):
    """Parameters of 37 rows, 3 rows, 1 row and 1 element."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, 24)
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.tiny = nn.Parameter(torch.randn(3, 40) * 0.1)
        self.row1 = nn.Parameter(torch.randn(1, 50) * 0.1)
        self.one = nn.Parameter(torch.ones(1))
        self.head = nn.Linear(24, V)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        h = h * self.one + self.tiny[:, :24].mean(0) + self.row1[:, :24]
        logits = self.head(h).float().reshape(-1, V)
        return nn.functional.cross_entropy(logits, y.reshape(-1))


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    from qshard.optim import AdamW4bit, AdamW8bit, OneBitAdam, ZeroOneAdam

    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2)
    if name == "8bit":
        return AdamW8bit(params, lr=1e-2, block_size=16, min_8bit_size=1)
    if name == "4bit":
        return AdamW4bit(params, lr=1e-2, block_size=16, min_4bit_size=1)
    if name == "onebit":
        return OneBitAdam(params, lr=1e-2, freeze_step=1)  # compressed from step 2 on
    return ZeroOneAdam(params, lr=1e-2)


def _build(world: int, layout: str, optim: str):
    """layout: fsdp (ZeRO-3 over every rank), zpp (ZeRO++ all, 2 ranks per node), hsdp (2
    ranks per node, replicated across nodes) or rep (replicated; the 1-bit optimizers)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from qshard.comm.topology import Topology
    from qshard.zeropp import ZeroPPConfig, shard

    model = _Odd()
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    rpn = {"fsdp": world}.get(layout, min(2, world))
    config = {
        "fsdp": ZeroPPConfig(),
        "zpp": ZeroPPConfig(qwz=True, hpz=True, qgz=True),
        "hsdp": ZeroPPConfig(hsdp=True, replicate_reduce=optim not in PER_RANK_OPTIMS),
    }.get(layout)
    if config is not None:
        topology = Topology(world_size=world, ranks_per_node=rpn)
        shard(model, topology=topology, config=config, mp_policy=bf16, blocks=list(model.blocks))
    return model, _optimizer(optim, model.parameters())


def _train(model, opt, steps: int) -> None:
    """Real steps, the same batch on every rank."""
    for s in range(steps):
        g = torch.Generator().manual_seed(100 + s)
        x = torch.randint(0, V, (2, 8), generator=g)
        model(x, torch.roll(x, 1, 1)).backward()
        opt.step()
        opt.zero_grad()


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _global_state(model, opt) -> dict[str, dict[str, object]]:
    names = {p: n for n, p in model.named_parameters()}
    out: dict[str, dict[str, object]] = {"param": {}, "state": {}}
    for n, p in model.named_parameters():
        out["param"][n] = _full(p.detach()).clone()
    for p, st in opt.state.items():
        out["state"][names[p]] = {
            k: _full(v).clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()
        }
    return out


def _given_step(model, opt, step: int) -> None:
    """One step with global gradients that depend on the parameter's name and ``step`` only."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for n, p in model.named_parameters():
        g = torch.randn(p.shape, generator=torch.Generator().manual_seed(zlib.crc32(n.encode())))
        g = g * (1 + step)
        p.grad = distribute_tensor(g, p.device_mesh, p.placements) if isinstance(p, DTensor) else g
    opt.step()
    opt.zero_grad()


def _diff(a, b, where: str = "") -> list[str]:
    if isinstance(a, dict):
        out = [f"{where}{k}: only on one side" for k in set(a) ^ set(b)]
        for k in sorted(set(a) & set(b), key=str):
            out += _diff(a[k], b[k], f"{where}{k}.")
        return out
    if isinstance(a, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return [f"{where} {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"]
        return [] if torch.equal(a, b) else [f"{where} differs"]
    return [] if a == b else [f"{where} {a!r} vs {b!r}"]


def _save(rank: int, world: int, root: Path, name: str, optim: str, layout: str) -> None:
    from qshard.train import checkpoint as ckpt

    model, opt = _build(world, layout, optim)
    _train(model, opt, 2)
    per_rank = optim in PER_RANK_OPTIMS and not name.endswith("_dcp")
    ckpt.save_checkpoint(root / name, step=2, model=model, optimizer=opt, per_rank=per_rank)
    if optim in PER_RANK_OPTIMS:
        return
    before = _global_state(model, opt)
    _given_step(model, opt, 3)  # the original world continues
    after = _global_state(model, opt)  # collective
    if rank == 0:
        torch.save({"before": before, "after": after}, root / f"{name}.pt")


def _load_dcp(rank: int, world: int, root: Path, name: str, optim: str, layout: str) -> list:
    from qshard.train import checkpoint as ckpt

    model, opt = _build(world, layout, optim)
    step = ckpt.load_checkpoint(root / name / "step_00000002", model=model, optimizer=opt)
    saved = torch.load(root / f"{name}.pt", weights_only=False)
    problems = [f"step {step}"] if step != 2 else []
    problems += [f"loaded {d}" for d in _diff(_global_state(model, opt), saved["before"])]
    _given_step(model, opt, 3)
    problems += [f"next step {d}" for d in _diff(_global_state(model, opt), saved["after"])]
    if rank == 0:  # the unsharded reference, from the saved global state
        ref = _Odd()
        ref_opt = _optimizer(optim, ref.parameters())
        with torch.no_grad():
            for n, p in ref.named_parameters():
                p.copy_(saved["before"]["param"][n])
        for n, p in ref.named_parameters():
            ref_opt.state[p] = {
                k: v.clone() if isinstance(v, torch.Tensor) else v
                for k, v in saved["before"]["state"][n].items()
            }
        _given_step(ref, ref_opt, 3)
        problems += [f"unsharded {d}" for d in _diff(_global_state(ref, ref_opt), saved["after"])]
    return problems


def _load_per_rank(rank: int, world: int, root: Path, name: str, optim: str, layout: str):
    """A per-rank checkpoint at another world, into an optimizer that has stepped already."""
    from qshard.optim._onebit import _ERROR_KEYS
    from qshard.train import checkpoint as ckpt

    model, opt = _build(world, layout, optim)
    _train(model, opt, 1)
    path = root / name / "step_00000002"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckpt.load_checkpoint(path, model=model, optimizer=opt)
    source = ckpt._hsdp_shard_index(model)  # rank 0's file; on HSDP node 0's of this shard
    saved = torch.load(path / f"rank_{source:05d}.pt", weights_only=False)
    problems = [
        f"model {n}"
        for n, t in model.state_dict().items()
        if not torch.equal(_local(t), _local(saved["model"][n]))
    ]
    here = opt.state_dict()["state"]
    for i, st in saved["optim"]["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and k not in _ERROR_KEYS:
                if not torch.equal(_local(here[i][k]), _local(v)):
                    problems.append(f"state {i}.{k}")
            elif k in _ERROR_KEYS and k in here[i] and _local(here[i][k]).abs().sum() != 0:
                problems.append(f"state {i}.{k} did not restart from zero")
    said = [str(w.message) for w in caught if "error buffers restart from zero" in str(w.message)]
    if not said:
        problems.append(f"no warning that the error buffers restart: {caught}")
    _train(model, opt, 1)
    if not all(torch.isfinite(_local(p)).all() for p in model.parameters()):
        problems.append("non-finite parameters after the next step")
    return problems


def _refused(rank: int, world: int, root: Path, name: str, optim: str, layout: str) -> str:
    """A 1-bit DCP checkpoint on another world: the refusal, and whether anything moved."""
    from qshard.train import checkpoint as ckpt

    model, opt = _build(world, layout, optim)
    _train(model, opt, 1)
    before = {n: _local(t).clone() for n, t in model.state_dict().items()}
    try:
        ckpt.load_checkpoint(root / name / "step_00000002", model=model, optimizer=opt)
    except ckpt.CheckpointError as exc:
        message = str(exc)
    else:
        message = "loaded"
    moved = [n for n, t in model.state_dict().items() if not torch.equal(_local(t), before[n])]
    return f"{message} | moved: {moved}"


def _world(rank: int, world: int, tmp: str, loads: list, saves: list) -> dict[str, object]:
    """Load every ``(name, optim, layout, kind)`` of ``loads``, then save every
    ``(name, optim, layout)`` of ``saves`` (names are folders under ``tmp``)."""
    root = Path(tmp)
    out: dict[str, object] = {}
    for name, optim, layout, kind in loads:
        fn = {"dcp": _load_dcp, "per_rank": _load_per_rank, "refused": _refused}[kind]
        try:
            out[name] = fn(rank, world, root, name, optim, layout)
        except Exception as exc:  # every rank refuses alike: reported by the case's test
            out[name] = [f"raised {type(exc).__name__}: {exc}"]
    for name, optim, layout in saves:
        _save(rank, world, root, name, optim, layout)
    return out


def _results(ranks: list[dict[str, object]], name: str) -> dict[int, object]:
    return {r: out[name] for r, out in enumerate(ranks)}


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """2 ranks -> 1 -> 2 (FSDP, bf16; the 1-bit optimizers replicated)."""
    tmp = str(tmp_path_factory.mktemp("reshard"))
    saves2 = [(f"{o}_fsdp2", o, "fsdp") for o in DCP_OPTIMS]
    saves2 += [(f"{o}_rep2", o, "rep") for o in PER_RANK_OPTIMS] + [("onebit_dcp", "onebit", "rep")]
    run_world(_world, 2, args=(tmp, [], saves2), timeout_s=240)
    loads1 = [(f"{o}_fsdp2", o, "fsdp", "dcp") for o in DCP_OPTIMS]
    loads1 += [(f"{o}_rep2", o, "rep", "per_rank") for o in PER_RANK_OPTIMS]
    loads1 += [("onebit_dcp", "onebit", "rep", "refused")]
    saves1 = [(f"{o}_fsdp1", o, "fsdp") for o in DCP_OPTIMS]
    saves1 += [(f"{o}_rep1", o, "rep") for o in PER_RANK_OPTIMS]
    one = run_world(_world, 1, args=(tmp, loads1, saves1), timeout_s=240)
    loads2 = [(f"{o}_fsdp1", o, "fsdp", "dcp") for o in DCP_OPTIMS]
    loads2 += [(f"{o}_rep1", o, "rep", "per_rank") for o in PER_RANK_OPTIMS]
    saves2b = [(f"{o}_fsdp2b", o, "fsdp") for o in DCP_OPTIMS]  # for the 2 -> 4 world
    two = run_world(_world, 2, args=(tmp, loads2, saves2b), timeout_s=240)
    return {"tmp": tmp, "one": one, "two": two}


@pytest.mark.parametrize("optim", DCP_OPTIMS)
def test_fsdp_2_ranks_to_1_continues_bit_for_bit(chain, optim):
    assert _results(chain["one"], f"{optim}_fsdp2") == {0: []}


@pytest.mark.parametrize("optim", DCP_OPTIMS)
def test_fsdp_1_rank_to_2_continues_bit_for_bit(chain, optim):
    assert _results(chain["two"], f"{optim}_fsdp1") == {0: [], 1: []}


@pytest.mark.parametrize("optim", PER_RANK_OPTIMS)
@pytest.mark.parametrize(("world", "saved"), [("one", "rep2"), ("two", "rep1")])
def test_per_rank_checkpoints_load_on_another_world_restarting_error_feedback(
    chain, optim, world, saved
):
    # Into an optimizer that has state already: the error buffers' recorded shapes follow the
    # world, and were refused as "saved from another configuration".
    results = _results(chain[world], f"{optim}_{saved}")
    assert all(problems == [] for problems in results.values()), results


def test_a_1bit_dcp_checkpoint_on_another_world_is_refused_naming_it(chain):
    message = chain["one"][0]["onebit_dcp"]
    assert "another configuration" not in message
    assert "holds OneBitAdam's error buffers, which are per rank" in message
    assert "saved on 2 ranks" in message and "(this job has 1)" in message
    assert "save_checkpoint(per_rank=True)" in message
    assert message.endswith("| moved: []")  # refused before anything was loaded


@pytest.fixture(scope="module")
def chain4(chain):
    """2 ranks -> 4 (FSDP -> HSDP 2 x 2), then 4 (2 nodes x 2: ZeRO++ all, HSDP) -> 2 (1 node
    x 2: FSDP, HSDP)."""
    tmp = chain["tmp"]
    loads4 = [(f"{o}_fsdp2b", o, "hsdp", "dcp") for o in DCP_OPTIMS]
    saves4 = [(f"{o}_zpp4", o, "zpp") for o in DCP_OPTIMS]
    saves4 += [(f"{o}_hsdp4", o, "hsdp") for o in DCP_OPTIMS + PER_RANK_OPTIMS]
    four = run_world(_world, 4, args=(tmp, loads4, saves4), timeout_s=480)
    loads2 = [(f"{o}_zpp4", o, "fsdp", "dcp") for o in DCP_OPTIMS]
    loads2 += [(f"{o}_hsdp4", o, "fsdp", "dcp") for o in DCP_OPTIMS]
    loads2 += [(f"{o}_hsdp4", o, "hsdp", "per_rank") for o in PER_RANK_OPTIMS]
    two = run_world(_world, 2, args=(tmp, loads2, []), timeout_s=480)
    return {"four": four, "two": two}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "name"),
    [("four", f"{o}_fsdp2b") for o in DCP_OPTIMS]
    + [("two", f"{o}_zpp4") for o in DCP_OPTIMS]
    + [("two", f"{o}_hsdp4") for o in DCP_OPTIMS + PER_RANK_OPTIMS],
)
def test_zeropp_and_hsdp_layouts_reshard(chain4, world, name):
    results = _results(chain4[world], name)
    assert all(problems == [] for problems in results.values()), results
