"""qshard.optim."""
