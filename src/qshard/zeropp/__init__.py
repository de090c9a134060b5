"""qshard.zeropp: ZeRO++ (qwZ, hpZ, qgZ) as plug-ins of PyTorch FSDP2.

``shard(model, topology=..., config=ZeroPPConfig(qwz=True, hpz=True, qgz=True))`` shards a
model with ``fully_shard`` per block and installs the quantized comms; the comms can also be
installed by hand with ``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``.
"""

from qshard.zeropp.all_gather import QuantizedAllGather, RecordingAllGather
from qshard.zeropp.config import ZeroPPConfig
from qshard.zeropp.reduce_scatter import (
    HierarchicalQuantizedReduceScatter,
    RecordingReduceScatter,
)
from qshard.zeropp.shard import find_blocks, shard

__all__ = [
    "HierarchicalQuantizedReduceScatter",
    "QuantizedAllGather",
    "RecordingAllGather",
    "RecordingReduceScatter",
    "ZeroPPConfig",
    "find_blocks",
    "shard",
]
