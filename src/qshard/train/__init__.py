"""qshard.train."""
