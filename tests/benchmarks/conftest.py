"""Fixtures of the benchmark tests: the benchmark scripts are not a package, so a test loads one
by path."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _load_benchmark(name: str) -> ModuleType:
    # The scripts import their siblings (`from _common import ...`), so benchmarks/ goes on the
    # path; the module is registered because dataclasses look their module up while a class is
    # built. Every call executes the script anew.
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None, name
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def load_benchmark() -> Callable[[str], ModuleType]:
    """``load_benchmark("throughput")``: benchmarks/throughput.py as a fresh module."""
    return _load_benchmark
