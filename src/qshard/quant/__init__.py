"""qshard.quant."""
