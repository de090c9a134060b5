"""The 1-bit compressed all-reduce vs a single-process float64 simulation of the same math
(zero-one-adam-algorithm.md, "1-bit compressed all-reduce"), over groups of 2, 3 and 4 ranks,
odd sizes, masks, error-feedback identities and the ledger's byte count."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

import qshard.comm.compressed as compressed
from qshard.comm.compressed import compressed_all_reduce, padded_numel, server_error_numel
from qshard.comm.ledger import CommLedger, recording
from qshard.comm.topology import Topology
from qshard.testing import run_world

IMPLEMENTATIONS = ("per_tensor", "vectorized")  # [Note: two implementations]


implementation = compressed._forced_round  # run the round with one of the two


# ------------------------------------------------------------------ pure helpers


@given(st.integers(0, 100_000), st.integers(1, 64))
def test_padded_numel_splits_into_whole_bytes(numel, world):
    c = padded_numel(numel, world)
    assert c >= max(numel, 1) and c % (8 * world) == 0 and c - max(numel, 1) < 8 * world
    assert server_error_numel(numel, world) * world == c


def test_padded_numel_rejects_bad_sizes():
    with pytest.raises(ValueError):
        padded_numel(-1, 2)
    with pytest.raises(ValueError):
        padded_numel(5, 0)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("numel", [1, 3, 7, 9, 16, 33, 1000])
def test_single_process_without_process_group(numel, impl):
    """No init_process_group: one rank, the same compression as the reference's world of 1,
    for sizes whose packed signs are not a multiple of 4 bytes (the scales used to be viewed
    out of the byte buffer at an unaligned offset); several tensors in one bucket."""
    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    g = torch.Generator().manual_seed(numel)
    numels = [numel, 5, 2 * numel + 1]
    ew = [torch.zeros(padded_numel(k, 1)) for k in numels]
    es = [torch.zeros(server_error_numel(k, 1)) for k in numels]
    for _ in range(3):
        ts = [torch.randn(k, generator=g) for k in numels]
        before = [(e.clone(), f.clone()) for e, f in zip(ew, es)]
        with implementation(impl):
            out = compressed_all_reduce(ts, ew, es)
        for t, o, (e0, f0), e1, f1 in zip(ts, out, before, ew, es):
            ref, ref_ew, ref_es = reference_round([t], [e0], [f0], None)
            # The scales are float32 sums of ~2000 squares: relative error up to ~1e-5.
            tol = {"rtol": 1e-4, "atol": 1e-4}
            torch.testing.assert_close(o.double(), ref, **tol)
            torch.testing.assert_close(e1.double(), ref_ew[0], **tol)
            torch.testing.assert_close(f1.double(), ref_es[0], **tol)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_masks_must_be_bool_and_buffers_may_have_any_shape(impl):
    """A float mask weighted the values (a 0.5 entry came back halved, and counted as half an
    element in the scale) instead of being refused; a worker error buffer of the right size
    but 2-D failed with a broadcasting error."""
    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    t = torch.randn(2, 3, generator=torch.Generator().manual_seed(0))
    ew, es = torch.zeros(padded_numel(6, 1)), torch.zeros(server_error_numel(6, 1))
    for bad, match in (
        (torch.tensor([[1.0, 1.0, 0.5], [0.5, 1.0, 1.0]]), "mask != 0"),
        (torch.ones(2, 3, dtype=torch.int64), "mask != 0"),
        (torch.ones(6, dtype=torch.bool), "reshape it like the tensor"),
    ):
        with pytest.raises(ValueError, match=match):
            compressed_all_reduce([t], [ew], [es], masks=[bad])
    assert not ew.any() and not es.any(), "a refused call must not touch the buffers"
    mask = torch.tensor([[True, False, True], [True, True, False]])
    ref_ew, ref_es = ew.clone(), es.clone()
    ew2 = torch.zeros(2, padded_numel(6, 1) // 2)
    ew_strided = torch.zeros(2 * padded_numel(6, 1))[::2]
    es2 = torch.zeros(server_error_numel(6, 1), 1)
    for _ in range(3):
        with implementation(impl):
            (ref,) = compressed_all_reduce([t], [ref_ew], [ref_es], masks=[mask])
            (a,) = compressed_all_reduce([t], [ew2], [es2], masks=[mask])
            (b,) = compressed_all_reduce([t], [ew_strided], [es], masks=[mask])
        assert torch.equal(a, ref) and torch.equal(b, ref)
        assert torch.equal(ew2.reshape(-1), ref_ew) and torch.equal(ew_strided, ref_ew)
        assert torch.equal(es2.reshape(-1), ref_es) and torch.equal(es, ref_es)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_out_shares_memory_with_nothing_but_its_own_input(impl):
    """``out=[y, x]`` for inputs ``[x, y]`` came back wrong on the per-tensor round (it writes
    out[0] before it reads the second input), and an ``out`` over an error buffer corrupted
    the error feedback on both: refused before anything is touched. An ``out`` that requires
    grad is written outside autograd (it raised half way, after buffers were written)."""
    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, generator=g), torch.randn(16, generator=g)
    ew = [torch.zeros(padded_numel(16, 1)) for _ in range(2)]
    es = [torch.zeros(server_error_numel(16, 1)) for _ in range(2)]
    big = torch.zeros(40)
    for tensors, out, match in (
        ([x, y], [y, x], r"out\[[01]\] shares memory with tensors\[[01]\]"),
        ([x, x], [x, x], r"out\[[01]\] shares memory with (tensors|out)\[[01]\]"),
        ([x, y], [ew[0], torch.empty(16)], r"out\[0\] shares memory with an error buffer"),
        ([x, y], [torch.empty(16), es[1]], r"out\[1\] shares memory with an error buffer"),
        ([big[:16], y], [big[1:17], torch.empty(16)], r"out\[0\] shares memory with tensors\[0\]"),
        ([x, y], [big[:16], big[10:26]], r"out\[0\] shares memory with out\[1\]"),
    ):
        before = [t.clone() for t in (x, y, big, *ew, *es)]
        with implementation(impl), pytest.raises(ValueError, match=match):
            compressed_all_reduce(tensors, ew, es, out=out)
        after = (x, y, big, *ew, *es)
        assert all(torch.equal(a, b) for a, b in zip(before, after)), "a refusal touched memory"
    with implementation(impl):
        expected = compressed_all_reduce([x, y], [e.clone() for e in ew], [e.clone() for e in es])
        outs = [torch.zeros(16), torch.zeros(16, requires_grad=True)]
        got = compressed_all_reduce([x, y], ew, es, out=outs)
    assert got[1] is outs[1] and outs[1].requires_grad and outs[1].grad_fn is None
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_a_single_tensor_for_a_list_is_named():
    """One tensor passed where a list of tensors is expected counts as its rows: the error
    said "got 5 tensors, 1 worker and 1 server buffers" for a single 5-element tensor."""
    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    t = torch.randn(5)
    ew, es = torch.zeros(padded_numel(5, 1)), torch.zeros(server_error_numel(5, 1))
    with pytest.raises(ValueError, match=r"a single tensor of shape \(5,\) was passed"):
        compressed_all_reduce(t, [ew], [es])
    with pytest.raises(ValueError, match=r"single tensor of shape \(5,\).*\[tensor\]"):
        compressed_all_reduce([t], [ew], [es], masks=torch.ones(5, dtype=torch.bool))
    # Buffers stacked in one tensor (one row per tensor) stay accepted: a row is a tensor.
    (out,) = compressed_all_reduce([t], ew.view(1, -1), es.view(1, -1))
    assert out.shape == t.shape


def reference_round(inputs, worker_errors, server_errors, mask):
    """One compressed all-reduce of one tensor, all ranks simulated in float64.

    inputs[i]: rank i's flat input; worker_errors[i] (C,), server_errors[i] (C/n,): rank i's
    buffers before the round. Returns (output, new worker errors, new server errors)."""
    n = len(inputs)
    k = inputs[0].numel()
    big_c = worker_errors[0].numel()
    c = big_c // n
    valid = torch.zeros(big_c, dtype=torch.float64)
    valid[:k] = 1.0 if mask is None else mask.reshape(-1).double()
    sent, new_worker = [], []
    for i in range(n):
        x = worker_errors[i].double().clone()
        x[:k] += inputs[i].double()
        x *= valid
        scale = x.norm() / math.sqrt(max(valid.sum().item(), 1.0))
        ci = scale * torch.where(x >= 0, 1.0, -1.0).double() * valid
        sent.append(ci)
        new_worker.append(x - ci)
    out = torch.zeros(big_c, dtype=torch.float64)
    new_server = []
    for r in range(n):
        part = slice(r * c, (r + 1) * c)
        v = valid[part]
        y = sum(ci[part] for ci in sent) / n * v + server_errors[r].double()
        scale = y.norm() / math.sqrt(max(v.sum().item(), 1.0))
        cs = scale * torch.where(y >= 0, 1.0, -1.0).double() * v
        new_server.append(y - cs)
        out[part] = cs
    return out[:k], new_worker, new_server


# ------------------------------------------------------------------ multi-rank


def _gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def _inputs(seed: int, n: int, shapes, scales) -> list[list[torch.Tensor]]:
    """inputs[i][j]: rank i's tensor j, reproducible on every rank."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g) * sc for s, sc in zip(shapes, scales)] for _ in range(n)]


def _check_against_reference(group, shapes, scales, masks, rounds, seed):
    n, me = dist.get_world_size(group), dist.get_rank(group)
    numels = [math.prod(s) for s in shapes]
    ew = [torch.zeros(padded_numel(k, n)) for k in numels]
    es = [torch.zeros(server_error_numel(k, n)) for k in numels]
    for rnd in range(rounds):
        all_inputs = _inputs(seed + rnd, n, shapes, scales)
        mine = all_inputs[me]
        all_ew = [_gather(e, group) for e in ew]
        all_es = [_gather(e, group) for e in es]
        before = [t.clone() for t in mine]
        out = compressed_all_reduce(mine, ew, es, masks=masks, group=group)
        assert all(torch.equal(a, b) for a, b in zip(mine, before)), "input was modified"
        for j, shape in enumerate(shapes):
            ref_out, ref_ew, ref_es = reference_round(
                [all_inputs[i][j].reshape(-1) for i in range(n)], all_ew[j], all_es[j], masks[j]
            )
            scale = ref_out.abs().max().item() + 1e-30
            assert out[j].shape == torch.Size(shape)
            torch.testing.assert_close(
                out[j].reshape(-1).double(), ref_out, rtol=1e-6, atol=1e-6 * scale
            )
            escale = max(ref_ew[me].abs().max().item(), scale)
            torch.testing.assert_close(ew[j].double(), ref_ew[me], rtol=1e-6, atol=1e-6 * escale)
            torch.testing.assert_close(es[j].double(), ref_es[me], rtol=1e-6, atol=1e-6 * escale)
            if masks[j] is not None:
                assert torch.all(out[j][~masks[j]] == 0)
            # Every rank reconstructs the identical tensor.
            for other in _gather(out[j], group):
                assert torch.equal(other, out[j])


def _check_out(group, cases):
    """``out=`` (fresh tensors, or the inputs themselves) gives bit for bit the result and the
    errors of a call without it, under both implementations; a bad ``out`` is refused before
    anything is touched."""
    n = dist.get_world_size(group)
    for impl in IMPLEMENTATIONS:
        for ci, (shapes, scales, masks) in enumerate(cases):
            numels = [math.prod(s) for s in shapes]
            buffers = {
                how: (
                    [torch.zeros(padded_numel(k, n)) for k in numels],
                    [torch.zeros(server_error_numel(k, n)) for k in numels],
                )
                for how in ("new", "fresh", "inputs")
            }
            for rnd in range(2):
                mine = _inputs(50 + 10 * ci + rnd, n, shapes, scales)[dist.get_rank(group)]
                got = {}
                with implementation(impl):
                    for how, (ew, es) in buffers.items():
                        ts = [t.clone() for t in mine]
                        out = {"new": None, "fresh": [torch.empty_like(t) for t in ts]}
                        out["inputs"] = ts
                        got[how] = compressed_all_reduce(
                            ts, ew, es, masks=masks, group=group, out=out[how]
                        )
                        if how != "new":
                            assert all(g is o for g, o in zip(got[how], out[how]))
                for how in ("fresh", "inputs"):
                    assert all(torch.equal(a, b) for a, b in zip(got[how], got["new"]))
                    for mine_e, new_e in zip(buffers[how], buffers["new"]):
                        assert all(torch.equal(a, b) for a, b in zip(mine_e, new_e))
    t = torch.randn(3, 4)
    ew, es = [torch.zeros(padded_numel(12, n))], [torch.zeros(server_error_numel(12, n))]
    for bad, match in (
        ([], "one out tensor per tensor"),
        ([torch.empty(12)], r"shape \(3, 4\)"),
        ([torch.empty(3, 4, dtype=torch.float64)], "float32"),
        ([torch.empty(4, 3).t()], "contiguous=False"),
    ):
        with pytest.raises(ValueError, match=match):
            compressed_all_reduce([t], ew, es, group=group, out=bad)
    assert not ew[0].any() and not es[0].any(), "a refused call must not touch the buffers"


def _check_error_feedback_identity(group, seed):
    """Sum over ranks: mean(input + e_w_old - e_w_new) + (e_s_old - e_s_new) == output, i.e.
    what was sent plus the new errors equals the input plus the old errors; and over T rounds
    the outputs average to the inputs' mean up to (bounded errors) / T."""
    n, _ = dist.get_world_size(group), dist.get_rank(group)
    me = dist.get_rank(group)
    k = 301
    ew, es = torch.zeros(padded_numel(k, n)), torch.zeros(server_error_numel(k, n))
    g = torch.Generator().manual_seed(seed)
    fixed = [torch.randn(k, generator=g) * (i + 1) for i in range(n)]
    total_out = torch.zeros(k, dtype=torch.float64)
    rounds = 60
    for _ in range(rounds):
        ew_old, es_old = ew.clone(), es.clone()
        (out,) = compressed_all_reduce([fixed[me]], [ew], [es], group=group)
        total_out += out.double()
        contrib = torch.zeros_like(ew_old, dtype=torch.float64)
        contrib[:k] = fixed[me].double()
        contrib += ew_old.double() - ew.double()
        summed = torch.stack(_gather(contrib.float(), group)).double().mean(0)
        server = torch.cat(_gather((es_old - es).contiguous(), group)).double()
        torch.testing.assert_close((summed + server)[:k], out.double(), rtol=0, atol=1e-5)
    mean_in = torch.stack(fixed).double().mean(0)
    drift = (total_out / rounds - mean_in).abs().max().item()
    # The errors stay bounded, so the time average converges like 1/T; 0.2 would already
    # fail for a compressor without error feedback (its bias is ~|x| per element).
    assert drift < 0.2 * mean_in.abs().max().item(), drift


def _check_ledger(group, world_rank):
    n = dist.get_world_size(group)
    ranks = dist.get_process_group_ranks(group)
    ledger = CommLedger(Topology(world_size=dist.get_world_size(), ranks_per_node=1))
    numels = [1000, 24]
    tensors = [torch.randn(k) for k in numels]
    ew = [torch.zeros(padded_numel(k, n)) for k in numels]
    es = [torch.zeros(server_error_numel(k, n)) for k in numels]
    with recording(ledger):
        compressed_all_reduce(tensors, ew, es, group=group, tag="t")
    # A new layout is checked once, with one all-gather of four int64 per rank; see
    # [Note: same tensors on every rank].
    (check,) = ledger.summary().select(tag="t/layout_check")
    assert check.op == "all_gather" and check.calls == 1 and check.tensor_bytes == n * 32
    ledger = CommLedger(Topology(world_size=dist.get_world_size(), ranks_per_node=1))
    with recording(ledger):  # the same layout again: no check, only the two collectives
        compressed_all_reduce(tensors, ew, es, group=group, tag="t")
    ledger.count("seen")
    ledger.step()
    ledger.count("seen", 2)
    # gather_summary dropped the events (benchmarks/comm_volume.py read them from it).
    exact = ledger.gather_summary(group)
    assert exact.events == (("seen", 3),) and exact.rows() == ledger.summary().rows()
    s = ledger.summary()
    width = sum(padded_numel(k, n) for k in numels) // n
    # One row per destination: the fp32 scales, the packed signs, padding to 4 bytes.
    per_rank = 4 * len(numels) + 4 * math.ceil(width // 8 / 4)
    (a2a,) = s.select(tag="t", op="all_to_all")
    (ag,) = s.select(tag="t", op="all_gather")
    assert a2a.calls == 1 and a2a.tensor_bytes == n * per_rank
    assert ag.calls == 1 and ag.tensor_bytes == n * per_rank
    sent = s.inter_node_bytes  # one rank per node: every byte leaves the node
    assert sent == pytest.approx(2 * (n - 1) * per_rank)
    # ~2 bits per element on the wire (vs 64 for an fp32 ring all-reduce).
    assert 8 * sent / sum(numels) < 2.3
    assert world_rank in ranks


def _check_errors(group):
    n = dist.get_world_size(group)
    t = torch.randn(10)
    with pytest.raises(ValueError, match="server_error_numel"):
        compressed_all_reduce([t], [torch.zeros(10)], [torch.zeros(5)], group=group)
    with pytest.raises(TypeError, match="float32"):
        compressed_all_reduce(
            [t.double()],
            [torch.zeros(padded_numel(10, n))],
            [torch.zeros(server_error_numel(10, n))],
            group=group,
        )
    with pytest.raises(ValueError, match="one worker and one server"):
        compressed_all_reduce([t], [], [], group=group)
    assert compressed_all_reduce([], [], [], group=group) == []


def _check_server_overflow(group):
    """Finite inputs whose sums of squares fit in float32 on every rank, but whose server chunk
    (the ranks' mean plus the server error of the round before) overflows in the second round:
    that round comes back all NaN on every rank and leaves every error buffer as it was (it
    came back +-Inf and stored Inf / NaN in the server error for good)."""
    values = ([9.049476576340607e18, -9.314996539820605e18], [1.29454827e19, 1.03762314e18])
    t = torch.tensor(values[dist.get_rank(group)])
    assert torch.isfinite(t.square().sum())
    ew, es = [torch.zeros(padded_numel(2, 2))], [torch.zeros(server_error_numel(2, 2))]
    first = compressed_all_reduce([t], ew, es, group=group)[0]
    assert bool(torch.isfinite(first).all())
    kept = (ew[0].clone(), es[0].clone())
    second = compressed_all_reduce([t], ew, es, group=group)[0]
    assert bool(second.isnan().all()), second
    assert torch.equal(ew[0], kept[0]) and torch.equal(es[0], kept[1])
    later = compressed_all_reduce([torch.tensor([1.0, -1.0])], ew, es, group=group)[0]
    assert bool(torch.isfinite(later).all()), later


def _check_layout_mismatch(group, world_rank):
    """Ranks passing different tensors are refused on every rank, with what each passed, and
    leave every buffer untouched: before, sizes that padded to the same width were silently
    mixed (7 elements averaged with 5, each rank returning its own shape), and other widths
    aborted the gloo process ("Received data size doesn't match expected size")."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    odd = me == n - 1  # one rank differs from the others

    def call(shapes, masked=(), match=None):
        ts = [torch.ones(s) for s in shapes]
        ew = [torch.zeros(padded_numel(t.numel(), n)) for t in ts]
        es = [torch.zeros(server_error_numel(t.numel(), n)) for t in ts]
        ms = [
            torch.ones(s, dtype=torch.bool) if i in masked else None for i, s in enumerate(shapes)
        ]
        if match is None:
            return compressed_all_reduce(ts, ew, es, masks=ms, group=group, tag="lay")
        with pytest.raises(ValueError, match=match):
            compressed_all_reduce(ts, ew, es, masks=ms, group=group, tag="lay")
        assert not any(e.any() for e in ew + es), "a refused call must not touch the buffers"

    every_rank = rf"rank {dist.get_process_group_ranks(group)[0]}: 1 tensors, "
    call([(5,) if odd else (7,)], match=every_rank + "(7|5) elements")  # same padded width
    call([(1000,) if odd else (7,)], match=r"the same number of tensors, with the same shapes")
    call([(3, 2) if odd else (2, 3)], match="the same totals in other shapes or another order")
    call([(4,), (3,)] if odd else [(3,), (4,)], match="other shapes or another order")
    call([(4,), (3,)] if odd else [(7,)], match="2 tensors, 7 elements")
    call([(9,)], masked=(0,) if odd else (), match="masks on the same tensors")
    # The group still works, and a layout that passed is not checked again.
    ledger = CommLedger(Topology(world_size=dist.get_world_size(), ranks_per_node=1))
    with recording(ledger):
        for _ in range(3):
            (out,) = call([(2, 3)])
            assert torch.equal(out, torch.ones(2, 3))
    assert ledger.summary().select(tag="lay/layout_check")[0].calls == 1
    assert ledger.summary().select(tag="lay", op="all_to_all")[0].calls == 3
    assert world_rank in dist.get_process_group_ranks(group)


def compressed_world(rank: int, world_size: int) -> None:
    assert world_size == 4
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    trio = dist.new_group([0, 1, 2])
    groups = [dist.group.WORLD, pairs[rank // 2]] + ([trio] if rank < 3 else [])
    mask = torch.rand(6, 5, generator=torch.Generator().manual_seed(3)) > 0.3
    cases = [
        # shapes, input scales, masks
        ([(1,)], [1.0], [None]),
        ([(7,), (13,), (2, 2, 2)], [1.0, 1e-3, 50.0], [None, None, None]),
        ([(1000,), (3,), (64,)], [1.0, 1.0, 1.0], [None, None, None]),
        ([(6, 5), (33,)], [1.0, 2.0], [mask, None]),
    ]
    for gi, group in enumerate(groups):
        for impl in IMPLEMENTATIONS:
            with implementation(impl):
                for ci, (shapes, scales, masks) in enumerate(cases):
                    seed = 100 * ci + gi
                    _check_against_reference(group, shapes, scales, masks, rounds=3, seed=seed)
                _check_error_feedback_identity(group, seed=7 + gi)
        _check_out(group, cases)
        _check_ledger(group, rank)
        _check_errors(group)
        _check_layout_mismatch(group, rank)
    for impl in IMPLEMENTATIONS:
        with implementation(impl):
            _check_server_overflow(pairs[rank // 2])
    if rank == 3:
        with pytest.raises(ValueError, match="not a member"):
            compressed_all_reduce([torch.ones(3)], [torch.zeros(24)], [torch.zeros(8)], group=trio)


def test_compressed_all_reduce_matches_simulation_groups_of_2_3_4():
    run_world(compressed_world, 4, timeout_s=240)
