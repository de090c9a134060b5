"""qshard: quantized, communication-efficient sharded training for PyTorch.

The top level names the pieces a user drops into a training script; each lives in the
sub-package that owns it:

- ``qshard.zeropp``: ZeRO++ on FSDP2 (:func:`shard`, :class:`ZeroPPConfig`: qwZ, hpZ, qgZ).
- ``qshard.comm``: :class:`Topology` (ranks grouped into nodes) and :class:`CommLedger` (bytes
  per collective, intra- vs inter-node); the 1-bit compressed all-reduce.
- ``qshard.optim``: 8-bit block-wise optimizers (:class:`AdamW8bit`, ...) and the
  communication-efficient data-parallel :class:`ZeroOneAdam` / :class:`OneBitAdam`.
- ``qshard.nn``: :class:`StableEmbedding`.
- ``qshard.quant``: the quantization formats and kernels underneath.

Names are imported on first use, so ``import qshard`` (and the ``qshard`` CLI) stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

from qshard._version import __version__

__all__ = [
    "Adam8bit",
    "AdamW8bit",
    "CommLedger",
    "OneBitAdam",
    "SGD8bit",
    "StableEmbedding",
    "Topology",
    "ZeroOneAdam",
    "ZeroPPConfig",
    "__version__",
    "optimizer_state_bytes",
    "shard",
]

_LAZY = {
    "Adam8bit": "qshard.optim",
    "AdamW8bit": "qshard.optim",
    "SGD8bit": "qshard.optim",
    "OneBitAdam": "qshard.optim",
    "ZeroOneAdam": "qshard.optim",
    "optimizer_state_bytes": "qshard.optim",
    "StableEmbedding": "qshard.nn",
    "Topology": "qshard.comm",
    "CommLedger": "qshard.comm",
    "ZeroPPConfig": "qshard.zeropp",
    "shard": "qshard.zeropp",
}


#: Subpackages reachable as attributes (``import qshard; qshard.optim.AdamW4bit``), imported
#: on first use as the lazy names are (before, only after something had imported them).
_SUBPACKAGES = frozenset({"comm", "integrations", "nn", "optim", "quant", "train", "zeropp"})


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES:
        return importlib.import_module(f"qshard.{name}")  # (binds itself on import)
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'qshard' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*__all__, *_SUBPACKAGES})
