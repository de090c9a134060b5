"""qshard.zeropp."""
