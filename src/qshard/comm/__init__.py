"""qshard.comm."""
