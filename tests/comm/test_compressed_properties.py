"""Property-based tests (hypothesis) of the 1-bit compressed all-reduce against a float64
simulation of every rank (``reference_round`` of test_compressed.py), over groups of 1..5
ranks (subgroups of ONE 5-rank world), tensors of 1..10^4 elements, several tensors per bucket,
several rounds of error feedback, and all-zero, constant, NaN/Inf, huge and denormal inputs;
both implementations ([Note: two implementations]), results in new tensors, in given ones and
in the inputs themselves (``out=``).

The bounds, from the compression (each rank sends ``s * sign(x)`` with ``s = ||x|| / sqrt(N)``
over the N valid elements, the server re-compresses its chunk the same way):

* the implementation computes in float32, so each scale carries the rounding of a sum of up to
  ``width`` squares: relative error <= ``width * 2**-24`` per stage, two stages;
* signs agree with the reference except where the reference value is within that rounding of 0
  (a tie); such elements may differ by up to twice their chunk's scale;
* nothing is lost: per round, ``out = mean_i(t_i + e_w,i - e_w,i') + (e_s - e_s')`` (the error
  feedback identity), to float32 rounding of the magnitudes involved;
* ``||C(x)|| = ||x||`` and ``||x - C(x)||^2 = 2 ||x||^2 - 2 ||x|| ||x||_1 / sqrt(N)
  <= 2 (1 - 1/sqrt(N)) ||x||^2`` for every compression, so after one round from zero errors
  ``||out - mean(t)|| <= 2 sqrt(2 (1 - 1/sqrt(N))) * mean_i ||t_i||``;
* a non-finite input anywhere makes that tensor all NaN on every rank and leaves its error
  buffers untouched (see [Note: non-finite inputs] in ``qshard.comm.compressed``).

All ranks draw the same examples (``derandomize``), take part in one all-reduce of a failure
flag per example so they fail together, and never shrink (a shrinking rank would leave the
others waiting in a collective).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from qshard.comm.compressed import compressed_all_reduce, padded_numel, server_error_numel
from qshard.testing import run_world
from tests.comm.test_compressed import IMPLEMENTATIONS, implementation, reference_round

WORLD = 5
KINDS = (
    "normal",
    "zero",
    "constant",
    "alternating",
    "tiny",
    "denormal",
    "huge",
    "nan",
    "inf",
    "-inf",
    "nan-masked",
)
NON_FINITE = ("nan", "inf", "-inf", "nan-masked", "huge")
UNDERFLOW = ("tiny", "denormal")

case = st.fixed_dictionaries(
    {
        "group": st.integers(1, WORLD),
        "numels": st.lists(
            st.one_of(st.integers(1, 70), st.integers(71, 10_000)), min_size=1, max_size=3
        ),
        "kind": st.sampled_from(KINDS),
        "bad_rank": st.integers(0, WORLD - 1),
        "rounds": st.integers(1, 3),
        "seed": st.integers(0, 2**20),
        "implementation": st.sampled_from(IMPLEMENTATIONS),
        "out": st.sampled_from(("new", "fresh", "inputs")),
    }
)


def _input(c: dict, n: int, rank: int, j: int, rnd: int) -> torch.Tensor:
    """Rank ``rank``'s tensor ``j`` in round ``rnd``; the example's kind applies to tensor 0
    (the others stay normal, to check that a bad tensor does not spill over)."""
    kind, numel = c["kind"], c["numels"][j]
    g = torch.Generator().manual_seed(c["seed"] * 131 + 1000 * rnd + rank * 7 + j)
    x = torch.randn(numel, generator=g)
    if j != 0:
        return x
    if kind == "zero":
        return torch.zeros(numel)
    if kind == "constant":
        return torch.full((numel,), 0.75)
    if kind == "alternating":  # an even group cancels exactly: the server sees ties at 0
        return torch.full((numel,), 0.5 * (-1) ** rank)
    if kind == "tiny":  # squares underflow in float32: nothing sent, all kept as error
        return x * 1e-30
    if kind == "denormal":
        return x * 1e-41
    if kind == "huge":  # finite, but the sum of squares overflows float32
        return x * 1e25
    if kind in ("nan", "inf", "-inf", "nan-masked") and rank == c["bad_rank"] % n:
        value = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "nan-masked": math.nan}
        x[0 if kind == "nan-masked" else c["seed"] % numel] = value[kind]
    return x


def _mask(c: dict, j: int) -> torch.Tensor | None:
    if c["kind"] != "nan-masked" or j != 0:
        return None
    m = torch.ones(c["numels"][0], dtype=torch.bool)
    m[0] = False  # the NaN sits on a structurally zero element: still propagated
    return m


def _gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def _same_everywhere(t: torch.Tensor, group) -> bool:
    return all(
        torch.equal(o.isnan(), t.isnan()) and torch.equal(o.nan_to_num(), t.nan_to_num())
        for o in _gather(t, group)
    )


def _check_case(c: dict, groups: dict[int, object], rank: int) -> str | None:
    """Runs the example on the ranks of its group; returns a failure message or None."""
    n = c["group"]
    if rank >= n:
        return None
    group, kind, numels = groups[n], c["kind"], c["numels"]
    masks = [_mask(c, j) for j in range(len(numels))]
    ew = [torch.zeros(padded_numel(k, n)) for k in numels]
    es = [torch.zeros(server_error_numel(k, n)) for k in numels]
    width = sum(padded_numel(k, n) for k in numels) // n
    rtol = 1e-5 + 2 * width * 2.0**-24  # two float32 sums of up to `width` squares
    for rnd in range(c["rounds"]):
        inputs = [[_input(c, n, r, j, rnd) for j in range(len(numels))] for r in range(n)]
        all_ew = [_gather(e, group) for e in ew]
        all_es = [_gather(e, group) for e in es]
        old_ew, old_es = [e.clone() for e in ew], [e.clone() for e in es]
        mine = [t.clone() for t in inputs[rank]]
        out = {"new": None, "fresh": [torch.empty_like(t) for t in mine], "inputs": mine}
        with implementation(c["implementation"]):
            out = compressed_all_reduce(mine, ew, es, masks=masks, group=group, out=out[c["out"]])
        for j, k in enumerate(numels):
            where = f"tensor {j} ({kind}, n={n}, numel={k}, round {rnd})"
            if not _same_everywhere(out[j], group):
                return f"{where}: ranks reconstructed different results"
            if j == 0 and kind in NON_FINITE:
                if not bool(out[j].isnan().all()):
                    return f"{where}: came back partly non-NaN: {out[j][:8].tolist()}"
                if not (torch.equal(ew[j], old_ew[j]) and torch.equal(es[j], old_es[j])):
                    return f"{where}: error buffers changed in a non-finite round"
                continue
            if not bool(torch.isfinite(out[j]).all()):
                return f"{where}: finite inputs gave a non-finite result"
            got = out[j].double()
            if j == 0 and kind in UNDERFLOW:
                if bool(got.any()):
                    return f"{where}: expected nothing sent (squares underflow)"
            else:
                ref, _, ref_es = reference_round(
                    [inputs[r][j] for r in range(n)], all_ew[j], all_es[j], masks[j]
                )
                tie = 1e-5 * ref.abs().max().item() + 1e-37
                # A tie: a worker's value, or the server's value before its compression
                # (= reference output + new server error), within rounding of 0.
                near = (torch.cat([e.double() for e in ref_es])[:k] + ref).abs() <= tie
                for r in range(n):
                    near |= (all_ew[j][r].double()[:k] + inputs[r][j].double()).abs() <= tie
                close = (got - ref).abs() <= rtol * ref.abs() + 1e-37
                bad = ~(close | near)
                if bool(bad.any()):
                    i = int(bad.nonzero()[0])
                    return (
                        f"{where}: element {i} = {got[i].item()}, reference {ref[i].item()} "
                        f"(rtol {rtol:.2e})"
                    )
            # Nothing is lost: the error feedback identity over all ranks, in float64.
            new_ew = _gather(ew[j], group)
            sent = torch.stack(
                [
                    inputs[r][j].double() + all_ew[j][r].double()[:k] - new_ew[r].double()[:k]
                    for r in range(n)
                ]
            ).mean(0)
            if masks[j] is not None:
                sent = sent * masks[j].double()
            server = torch.cat(
                [a.double() - b.double() for a, b in zip(all_es[j], _gather(es[j], group))]
            )[:k]
            # float32 rounding of the buffers that were added: relative to their magnitude
            mag = max(
                got.abs().max().item(),
                server.abs().max().item(),
                *(inputs[r][j].abs().max().item() for r in range(n)),
                *(e.abs().max().item() for e in all_ew[j] + new_ew),
            )
            if not bool(((sent + server - got).abs() <= 4 * rtol * mag + 1e-37).all()):
                return f"{where}: error feedback identity violated"
            if rnd == 0 and (j != 0 or kind in ("normal", "constant")):
                # Both stages compress at most k valid elements; the bound grows with N.
                bound = 2 * math.sqrt(2 * (1 - 1 / math.sqrt(k)))
                mean_in = torch.stack([inputs[r][j].double() for r in range(n)]).mean(0)
                norms = sum(inputs[r][j].double().norm().item() for r in range(n)) / n
                if (got - mean_in).norm().item() > (bound + 4 * rtol) * norms:
                    return f"{where}: ||out - mean|| above the compression bound"
    return None


def _example(c, groups, rank):
    message = _check_case(c, groups, rank)
    flag = torch.tensor([0.0 if message is None else 1.0])
    dist.all_reduce(flag)  # every rank fails on the same example
    assert flag.item() == 0, message or "another rank failed this example"


def properties_world(rank: int, world: int, max_examples: int) -> int:
    groups = {k: dist.new_group(list(range(k))) for k in range(1, world + 1)}
    check = settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        phases=(Phase.generate,),
    )(given(c=case)(_example))
    check(groups=groups, rank=rank)
    return rank


def test_compressed_all_reduce_properties_groups_of_1_to_5():
    run_world(properties_world, WORLD, args=(25,), timeout_s=600)


@pytest.mark.slow
def test_compressed_all_reduce_properties_many_examples():
    run_world(properties_world, WORLD, args=(400,), timeout_s=3000)
