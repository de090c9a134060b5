"""qshard.optim: 8-bit block-wise optimizers (Adam8bit, AdamW8bit, SGD8bit, RMSprop8bit,
Lion8bit, Adagrad8bit), 4-bit Adam4bit/AdamW4bit, and communication-efficient data-parallel
Adam."""

from qshard.optim._base8bit import Optimizer8bit, optimizer_state_bytes, state_bytes_per_param
from qshard.optim._overrides import register_full_precision_state
from qshard.optim.adagrad8bit import Adagrad8bit
from qshard.optim.adam4bit import Adam4bit, AdamW4bit
from qshard.optim.adam8bit import Adam8bit, AdamW8bit
from qshard.optim.lion8bit import Lion8bit
from qshard.optim.onebit_adam import OneBitAdam
from qshard.optim.rmsprop8bit import RMSprop8bit
from qshard.optim.sgd8bit import SGD8bit
from qshard.optim.zero_one_adam import ZeroOneAdam

__all__ = [
    "Adagrad8bit",
    "Adam4bit",
    "Adam8bit",
    "AdamW4bit",
    "AdamW8bit",
    "Lion8bit",
    "OneBitAdam",
    "Optimizer8bit",
    "RMSprop8bit",
    "SGD8bit",
    "ZeroOneAdam",
    "optimizer_state_bytes",
    "register_full_precision_state",
    "state_bytes_per_param",
]
