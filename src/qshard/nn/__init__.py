"""qshard.nn."""
