"""qshard._fsdp reads FSDP2's per-unit state and PREMUL_SUM's factor on every supported torch.

CI runs one torch (2.13); these fakes stand for the shapes of the others, so the accessor's
fallbacks are exercised here too ([Note: FSDP2 across torch versions]). The real objects are
exercised by every ZeRO++ test on the torch that runs them.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from qshard._fsdp import fsdp_param_groups, prefetch_unshard, premul_sum_factor


class _Unit:
    def __init__(self, state: object) -> None:
        self._state = state

    def _get_fsdp_state(self) -> object:
        return self._state


class _State:
    def __init__(self, **attrs: object) -> None:
        self.__dict__.update(attrs)


def test_param_groups_plural_list():  # torch 2.13
    group = object()
    assert fsdp_param_groups(_Unit(_State(_fsdp_param_groups=[group]))) == [group]
    assert fsdp_param_groups(_Unit(_State(_fsdp_param_groups=[]))) == []


def test_param_groups_single_group():  # torch 2.9 and 2.11
    group = object()
    assert fsdp_param_groups(_Unit(_State(_fsdp_param_group=group))) == [group]
    assert fsdp_param_groups(_Unit(_State(_fsdp_param_group=None))) == []


def test_param_groups_unknown_layout():
    assert fsdp_param_groups(_Unit(_State())) is None
    assert fsdp_param_groups(object()) is None  # not an FSDPModule


def test_prefetch_unshard_calls_fsdp2s_prefetch_per_group(monkeypatch):
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    calls = []
    monkeypatch.setattr(
        FSDPParamGroup, "_prefetch_unshard", staticmethod(lambda g, p: calls.append((g, p)))
    )
    a, b = object(), object()
    assert prefetch_unshard(_Unit(_State(_fsdp_param_groups=[a, b])), "backward") is True
    assert calls == [(a, "backward"), (b, "backward")]
    # groups kept some unknown way, or no such function in this torch: nothing issued
    assert prefetch_unshard(_Unit(_State()), "forward") is False
    monkeypatch.delattr(FSDPParamGroup, "_prefetch_unshard")
    assert prefetch_unshard(_Unit(_State(_fsdp_param_groups=[a])), "forward") is False
    assert len(calls) == 2


class _OldPremulSum:  # torch 2.11's ReduceOp: the factor only in its pickled state
    def __getstate__(self) -> tuple[object, float]:
        return (dist.ReduceOp.PREMUL_SUM, 0.125)


def test_premul_sum_factor():
    assert premul_sum_factor(dist._make_nccl_premul_sum(0.25)) == 0.25
    assert premul_sum_factor(_OldPremulSum()) == 0.125


def test_premul_sum_tensor_factor_refused():
    class _TensorFactor:
        factor = object()

    with pytest.raises(TypeError, match="tensor factor"):
        premul_sum_factor(_TensorFactor())
