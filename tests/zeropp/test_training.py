"""End to end: a small GPT trained 20 steps with FSDP2 vs shard() with each ZeRO++ feature.

* shard() with every feature off (recording comms, prefetching on) and hpZ alone must give
  bit-identical losses to plain ``fully_shard`` per block + root (hpZ's secondary copy holds
  the forward's own unsharded weights), also with a forward that no backward follows (under
  ``no_grad`` or with autograd on) between backward and the optimizer step (the root, kept
  blocks and hpZ's secondary shards do not outlive the step).
* qwZ, qgZ and all three: every step's loss within a stated tolerance of the baseline.
* With qwZ every rank computes with identical dequantized weights; after training every
  rank's view of the full parameters is identical.
* The ledger: hpZ's backward gather never leaves the node; qwZ/qgZ shrink the cross-node bytes.
* The root and the last ``keep_last_blocks`` blocks (by default ``prefetch_depth + 1``: here
  both blocks) are not gathered again in backward; the losses are bit-identical for any count.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from qshard.comm import CommLedger, Topology, recording
from qshard.testing import run_world
from qshard.train.model import GPT, GPTConfig
from qshard.zeropp import ZeroPPConfig, shard

STEPS = 20
CFG = GPTConfig(vocab_size=64, context=16, n_layer=2, n_head=2, n_embd=32, seed=0)


def _batches(rank: int, steps: int = STEPS):
    # A learnable stream (next token = 3 * token + 1 mod vocab, from random starts), so the loss
    # falls within 20 steps; each rank draws its own batches.
    g = torch.Generator().manual_seed(1234 + rank)
    for _ in range(steps):
        tok = torch.randint(0, CFG.vocab_size, (4, 1), generator=g)
        cols = [tok]
        for _ in range(CFG.context):
            cols.append((cols[-1] * 3 + 1) % CFG.vocab_size)
        idx = torch.cat(cols, dim=1)
        yield idx[:, :-1], idx[:, 1:]


def _train(model, rank: int, ledger: CommLedger | None = None):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    losses, steps = [], []
    for x, y in _batches(rank):
        if ledger is not None:
            with recording(ledger):
                _, loss = model(x, y)
                loss.backward()
            steps.append(ledger.step())
        else:
            _, loss = model(x, y)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, steps


def _full_params(model) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def _unsharded_views_identical(model) -> bool:
    """Unshard every FSDP unit (through the installed comm) and check ranks agree bit for bit."""
    ok = True
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.unshard()
    for p in model.parameters():
        t = p.detach().to_local() if hasattr(p, "to_local") else p.detach()
        gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, t.contiguous())
        ok &= all(torch.equal(g, gathered[0]) for g in gathered)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    return ok


def _groups() -> int:
    return len(dist.distributed_c10d._world.pg_map)  # the process groups this rank holds


def _run(rank: int, world: int, rpn: int, names: tuple[str, ...]) -> dict:
    groups_at_start = _groups()
    topo = Topology(world_size=world, ranks_per_node=rpn)
    mesh = init_device_mesh("cpu", (world,))
    results: dict = {}

    base = GPT(CFG)
    for block in base.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(base, mesh=mesh)
    results["plain"], _ = _train(base, rank)
    results["plain_params"] = _full_params(base)

    configs = {
        "off": ZeroPPConfig(),
        "hpz": ZeroPPConfig(hpz=True, keep_last_blocks=0),  # a backward gather to check
        "qwz": ZeroPPConfig(qwz=True),
        "qgz": ZeroPPConfig(qgz=True, pipeline_stages=2),
        "all": ZeroPPConfig(qwz=True, hpz=True, qgz=True, pipeline_stages=2),
        "all_int4": ZeroPPConfig(qwz=True, hpz=True, qgz=True, weight_bits=4),
        "off_k0": ZeroPPConfig(keep_last_blocks=0),
        "off_k1": ZeroPPConfig(keep_last_blocks=1),
        "all_k0": ZeroPPConfig(qwz=True, hpz=True, qgz=True, pipeline_stages=2, keep_last_blocks=0),
    }
    for name in names:
        cfg = configs[name]
        model = shard(GPT(CFG), topology=topo, config=cfg)
        if cfg.hpz:
            results[f"{name}_secondary"] = _secondary_shard_bytes(model, topo, cfg)
        ledger = CommLedger(topo)
        losses, steps = _train(model, rank, ledger)
        if cfg.hpz:
            results[f"{name}_secondary"] = results[f"{name}_secondary"]()
        results[name] = losses
        last = steps[-1]
        results[f"{name}_bytes"] = {
            (e.tag, e.op): (e.intra_node_bytes, e.inter_node_bytes) for e in last.entries
        }
        params = _full_params(model)
        gathered = [None] * world
        dist.all_gather_object(gathered, [p.sum().item() for p in params])
        results[f"{name}_params_agree"] = all(g == gathered[0] for g in gathered)
        results[f"{name}_unsharded_agree"] = _unsharded_views_identical(model)
        if name in ("off", "hpz", "off_k0", "off_k1"):
            results[f"{name}_params_equal_plain"] = all(
                torch.equal(a, b) for a, b in zip(params, results["plain_params"])
            )
    del results["plain_params"]
    results["eval_before_step"] = _eval_before_step(rank, topo, mesh)
    results["groups_added"] = _groups() - groups_at_start
    return results


def _eval_before_step(rank: int, topo: Topology, mesh) -> dict:
    """backward, a forward that no backward follows (under no_grad, or with autograd on: a
    metric), then the optimizer step: no unit that stays unsharded after forward (the root,
    kept blocks, hpZ's secondary shards) may carry the old weights into the next forward
    ([Note: no backward, no stale copy]). The reference is plain FSDP2 with its root resharded
    by hand after that forward (FSDP2 keeps its root, and computed the next forward's embeddings
    and head with the old weights)."""

    def train(model, grad: bool, plain: bool) -> tuple[list[float], list[torch.Tensor]]:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for i, (x, y) in enumerate(_batches(rank)):
            if i == 4:
                break
            _, loss = model(x, y)
            loss.backward()
            with torch.set_grad_enabled(grad):
                losses.append((loss.item(), model(x, y)[1].item()))
            if plain:
                model.reshard()  # FSDP2's documented way out
            opt.step()
            opt.zero_grad()
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()  # the root stays unsharded after forward (FSDP2's rule)
        return losses, _full_params(model)

    out = {}
    for grad in (False, True):
        base = GPT(CFG)
        for block in base.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(base, mesh=mesh)
        want = train(base, grad, plain=True)
        for name, cfg in (
            ("off", ZeroPPConfig()),
            ("hpz", ZeroPPConfig(hpz=True)),
            ("hpz_k0", ZeroPPConfig(hpz=True, keep_last_blocks=0)),
        ):
            losses, params = train(shard(GPT(CFG), topology=topo, config=cfg), grad, plain=False)
            key = f"{name}_{'grad' if grad else 'no_grad'}"
            out[key] = losses == want[0] and all(map(torch.equal, params, want[1]))
    return out


def _secondary_shard_bytes(model, topo: Topology, cfg: ZeroPPConfig):
    """hpZ's secondary shards held at the end of the first forward (every block has run), next
    to the train app's memory estimate of them: it priced every parameter, where the kept last
    blocks and the root stay unsharded (a first-user probe: 2.06x too high). Returns a getter
    of (held bytes, estimated bytes) once a forward has run."""
    from qshard._fsdp import fsdp_param_groups
    from qshard.train.estimate import estimate_memory

    held: list[int] = []

    def measure(module, args, output) -> None:
        if held:
            return
        total = 0
        for m in model.modules():
            for group in fsdp_param_groups(m) or ():
                for fp in group.fsdp_params:
                    data = getattr(fp, "_sharded_post_forward_param_data", None)
                    total += 0 if data is None else data.numel() * data.element_size()
        held.append(total)

    handle = model.register_forward_hook(measure)
    blocks = list(model.blocks)
    resharded = blocks[: len(blocks) - cfg.kept_blocks]
    rows = estimate_memory(
        num_params=sum(p.numel() for p in model.parameters()),
        largest_unit_params=1,
        world_size=topo.world_size,
        ranks_per_node=topo.ranks_per_node,
        features=frozenset({"hpz"}),
        optim="adamw",
        hpz_params=sum(p.numel() for b in resharded for p in b.parameters()),
    )

    def result() -> tuple[int, float]:
        handle.remove()
        return held[0], rows.get("hpZ secondary shard", 0.0)

    return result


def _check(out: list[dict], nodes: int, names: tuple[str, ...]) -> None:
    for rank, r in enumerate(out):
        assert r["off"] == r["plain"], f"rank {rank}: features off must be plain FSDP2"
        assert r["off_params_equal_plain"]
        if "hpz" in names:
            assert r["hpz"] == r["plain"], f"rank {rank}: hpZ must be bit-identical"
            assert r["hpz_params_equal_plain"]
        # tolerance: |loss - baseline loss| per step, relative to the initial loss
        for name, same_as in (("off_k0", "plain"), ("off_k1", "plain"), ("all_k0", "all")):
            if name in names:  # which blocks reshard changes no value
                assert r[name] == r[same_as], (name, rank)
        for name, tol in (("qwz", 0.01), ("qgz", 0.03), ("all", 0.03), ("all_int4", 0.1)):
            if name not in names:
                continue
            diffs = [abs(a - b) / r["plain"][0] for a, b in zip(r[name], r["plain"])]
            assert max(diffs) < tol, (name, rank, max(diffs))
        # training trains
        assert r["plain"][-1] < 0.8 * r["plain"][0]
        for name in names:
            assert r[name][-1] < 0.8 * r[name][0], name
        for name in names:
            assert r[f"{name}_params_agree"], name
            assert r[f"{name}_unsharded_agree"], name
        assert all(r["eval_before_step"].values()), (rank, r["eval_before_step"])
        for name in ("hpz", "all", "all_k0"):
            if name in names and nodes > 1:  # the estimate vs what hpZ held (padding: < 10%)
                held, estimated = r[f"{name}_secondary"]
                assert estimated <= held <= 1.1 * estimated, (name, held, estimated)
                assert (held > 0) is (name != "all"), (name, held)  # "all" keeps both blocks
    # Every shard() of the job shares the topology's two groups, their two twins ([Note: gloo
    # exchanges are half duplex] in qshard.comm.duplex) and one hpZ secondary mesh (two
    # groups): FSDP2 alone would build a mesh per unit per call ([Note: one secondary mesh per
    # job]), 2 per unit here, 6 per hpZ config.
    for r in out:
        assert r["groups_added"] <= 6, r["groups_added"]
    r = out[0]
    fwd = ("fwd_all_gather", "all_gather")
    bwd = ("bwd_all_gather", "all_gather")
    if "hpz" in names:
        assert r["hpz_bytes"][bwd][1] == 0  # hpZ: the backward gather stays in the node
        assert r["hpz_bytes"][bwd][0] > 0
    if "off_k0" in names:
        # Backward gathers again only what forward resharded, never the root (FSDP2's rule for a
        # root; an explicit reshard_after_forward would reshard it): with keep_last_blocks=0
        # both equal blocks, with 1 block 0 alone, by default (prefetch_depth + 1 = 2) nothing.
        both, one = r["off_k0_bytes"][bwd], r["off_k1_bytes"][bwd]
        assert both == (2 * one[0], 2 * one[1]) and one[0] > 0, (both, one)
        assert sum(both) < sum(r["off_bytes"][fwd]), (both, r["off_bytes"][fwd])  # the root
        assert bwd not in r["off_bytes"], r["off_bytes"]
    if nodes > 1 and "qwz" in names and "qgz" in names:
        assert r["off_k1_bytes"][bwd][1] > 0
        # INT8 codes + scales vs fp32 is 1/4 + 1/256; on this toy model (shards of 8 to 1024
        # elements) padding every parameter's shard to whole 256-blocks adds ~60% (see
        # [Note: qwZ block layout]); the collective tests check exact byte counts.
        ratio = r["qwz_bytes"][fwd][1] / r["off_bytes"][fwd][1]
        assert 0.25 < ratio < 0.45, ratio
        # gloo runs the plain reduce-scatter as an all-reduce (recorded as one)
        rs_off = r["off_bytes"][("grad_reduce_scatter", "all_reduce")][1]
        rs_q = r["qgz_bytes"][("grad_reduce_scatter", "all_to_all")][1]
        assert rs_q < rs_off / 4, (rs_q, rs_off)


DEFAULT = ("off", "hpz", "qwz", "qgz", "all", "off_k0", "off_k1", "all_k0")
EVERYTHING = (*DEFAULT, "all_int4")


def test_training_2x2():
    _check(run_world(_run, 4, args=(2, DEFAULT), timeout_s=600), nodes=2, names=DEFAULT)


@pytest.mark.slow
def test_training_2x2_int4_weights():
    names = ("off", "all_int4")
    _check(run_world(_run, 4, args=(2, names), timeout_s=600), nodes=2, names=names)


@pytest.mark.slow
def test_training_1x2_single_node():
    _check(run_world(_run, 2, args=(2, EVERYTHING), timeout_s=600), nodes=1, names=EVERYTHING)
