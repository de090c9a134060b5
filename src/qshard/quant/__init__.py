"""qshard.quant: number formats and kernels, pure functions on tensors (no distributed code).

* :mod:`~qshard.quant.blockwise`: symmetric absmax INT8/INT4 block quantization (qwZ, qgZ).
* :mod:`~qshard.quant.dynamic`: dynamic / linear 8-bit code maps and block-wise codebook
  quantization (8-bit optimizer state).
* :mod:`~qshard.quant.signs`: 1-bit sign packing (1-bit Adam, 0/1 Adam).

CPU tensors use fast kernels that are bit-identical to the plain torch reference; turn them
off with ``QSHARD_QUANT_FASTPATH=0`` or :func:`set_fastpath`.
"""

from qshard.quant._fastpath import fastpath_enabled, set_fastpath
from qshard.quant.blockwise import (
    DEFAULT_BLOCK_SIZE,
    BlockQuantized,
    code_step,
    dequantize_blocks,
    dequantize_blockwise,
    pack_int4,
    qmax_for_bits,
    quantize_blocks,
    quantize_blockwise,
    unpack_int4,
)
from qshard.quant.dynamic import (
    DEFAULT_CODEBOOK_BLOCK_SIZE,
    dequantize_codebook,
    dynamic_map,
    linear_map,
    quantize_codebook,
)
from qshard.quant.signs import pack_signs, unpack_signs

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_CODEBOOK_BLOCK_SIZE",
    "BlockQuantized",
    "code_step",
    "dequantize_blocks",
    "dequantize_blockwise",
    "dequantize_codebook",
    "dynamic_map",
    "fastpath_enabled",
    "linear_map",
    "pack_int4",
    "pack_signs",
    "qmax_for_bits",
    "quantize_blocks",
    "quantize_blockwise",
    "quantize_codebook",
    "set_fastpath",
    "unpack_int4",
    "unpack_signs",
]
