"""qshard.comm: where ranks sit (:class:`Topology`) and what every collective costs
(:class:`CommLedger`), split into intra-node and inter-node bytes; :mod:`qshard.comm.duplex`
runs 2-rank exchanges on gloo both ways at once.

Importing it installs an exit handler that lets gloo's worker threads finish with their
tensors before the interpreter shuts down (see ``qshard/comm/_exit.py``).
"""

from qshard.comm import _exit  # noqa: F401  (installs the handler)
from qshard.comm.compressed import compressed_all_reduce, padded_numel, server_error_numel
from qshard.comm.ledger import (
    OPS,
    CommLedger,
    LedgerEntry,
    LedgerSummary,
    active_ledger,
    record,
    recording,
)
from qshard.comm.topology import Topology

__all__ = [
    "OPS",
    "CommLedger",
    "LedgerEntry",
    "LedgerSummary",
    "Topology",
    "active_ledger",
    "compressed_all_reduce",
    "padded_numel",
    "record",
    "recording",
    "server_error_numel",
]
