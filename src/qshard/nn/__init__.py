"""qshard.nn: layers that 8-bit training needs (StableEmbedding)."""

from qshard.nn.stable_embedding import StableEmbedding

__all__ = ["StableEmbedding"]
