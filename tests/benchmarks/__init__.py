"""Tests of the benchmark tooling (benchmarks/)."""
