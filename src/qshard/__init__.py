"""qshard: quantized, communication-efficient sharded training for PyTorch.

ZeRO++ (qwZ, hpZ, qgZ) on top of FSDP2, 0/1 Adam and 1-bit Adam with compressed
all-reduce, and 8-bit block-wise optimizers.
"""

from qshard._version import __version__

__all__ = ["__version__"]
