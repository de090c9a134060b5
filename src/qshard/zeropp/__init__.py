"""qshard.zeropp: ZeRO++ (qwZ, hpZ, qgZ) as plug-ins of PyTorch FSDP2.

``shard(model, topology=..., config=ZeroPPConfig(qwz=True, hpz=True, qgz=True))`` shards a
model with ``fully_shard`` per block and installs the quantized comms; the comms can also be
installed by hand with ``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``.
``ZeroPPConfig(hsdp=True)`` shards inside a node and replicates across nodes (HSDP), with an
optionally compressed inter-node gradient all-reduce (:class:`ReplicateAllReduce`; by hand,
``FSDPModule.set_all_reduce_hook``, or :class:`RecordingAllReduceHook` to only record the native
one).
"""

from qshard.zeropp._keep import set_keep_weights_after_backward
from qshard.zeropp._overlap import OverlapQueue
from qshard.zeropp.all_gather import QuantizedAllGather, RecordingAllGather
from qshard.zeropp.all_reduce import RecordingAllReduceHook, ReplicateAllReduce
from qshard.zeropp.config import ZeroPPConfig
from qshard.zeropp.reduce_scatter import (
    HierarchicalQuantizedReduceScatter,
    RecordingReduceScatter,
)
from qshard.zeropp.shard import HSDP_MESH_DIMS, find_blocks, hsdp_mesh, shard
from qshard.zeropp.step_in_backward import StepInBackward

__all__ = [
    "HSDP_MESH_DIMS",
    "HierarchicalQuantizedReduceScatter",
    "OverlapQueue",
    "QuantizedAllGather",
    "RecordingAllGather",
    "RecordingAllReduceHook",
    "RecordingReduceScatter",
    "ReplicateAllReduce",
    "StepInBackward",
    "ZeroPPConfig",
    "find_blocks",
    "hsdp_mesh",
    "set_keep_weights_after_backward",
    "shard",
]
