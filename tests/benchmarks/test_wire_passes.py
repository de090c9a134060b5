"""benchmarks/wire_passes.py runs end to end on a small model and odd topologies, and refuses
bad arguments: its passes check the fused results against the composition before timing, so a
run is also a bit-exactness check on the model's real shard layout."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(("nodes", "per_node"), [(2, 2), (3, 1), (1, 3)])
def test_wire_passes_small(load_benchmark, tmp_path, nodes, per_node):
    out = tmp_path / "wire.md"
    argv = ["--n-layer", "1", "--n-embd", "40", "--n-head", "2", "--context", "8"]
    argv += ["--nodes", str(nodes), "--ranks-per-node", str(per_node), "--block-size", "16"]
    assert load_benchmark("wire_passes").main([*argv, "--repeat", "1", "--out-md", str(out)]) == 0
    text = out.read_text()
    assert "all five, per rank and step" in text and "Same bytes and values" in text


def test_wire_passes_refuses_bad_arguments(load_benchmark):
    with pytest.raises(SystemExit):
        load_benchmark("wire_passes").main(["--nodes", "0"])
