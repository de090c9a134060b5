"""The Llama of ``qshard train --model llama``: ``transformers``' ``LlamaForCausalLM`` (RoPE,
grouped-query attention, RMSNorm, SwiGLU) built from a config, behind the interface the loop
uses for :class:`~qshard.train.model.GPT`: ``model(idx, targets) -> (logits, loss)``,
``model.blocks`` (the decoder layers, which FSDP2 shards one by one), ``model.config``.

``transformers`` is optional (it is in the ``dev`` extra); it is imported when a :class:`Llama`
is built, and :func:`transformers_missing` lets the launcher refuse ``--model llama`` before
any rank starts.

Sizes come from the same flags as the GPT's: ``n_embd``, ``n_layer``, ``n_head``, ``context``.
Key/value heads: ``n_head // 2`` when ``n_head`` is even (grouped-query attention, two query
heads per key/value head), else ``n_head``. The SwiGLU hidden width is ``8/3 n_embd`` rounded
up to a multiple of 8, so its three matrices hold as many weights as the GPT's 4x MLP.
"""

from __future__ import annotations

import copy
import importlib.util
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["INSTALL_TRANSFORMERS", "Llama", "LlamaSpec", "transformers_missing"]

INSTALL_TRANSFORMERS = (
    "pip install transformers (it is in qshard's dev extra: pip install -e '.[dev]')"
)


def transformers_missing() -> bool:
    """True when ``transformers`` cannot be imported here."""
    return importlib.util.find_spec("transformers") is None


@dataclass(frozen=True, kw_only=True, slots=True)
class LlamaSpec:
    """Shape and initialization of a :class:`Llama`."""

    vocab_size: int = 256
    """Number of token ids; 256 for the byte-level corpus of ``qshard train``."""
    context: int = 128
    """Maximum sequence length (RoPE's ``max_position_embeddings``)."""
    n_layer: int = 4
    """Decoder layers."""
    n_head: int = 4
    """Query heads; must divide ``n_embd``."""
    n_kv_head: int = 2
    """Key/value heads; must divide ``n_head`` (fewer than ``n_head``: grouped-query)."""
    n_embd: int = 256
    """Width of the residual stream."""
    seed: int = 0
    """Seed of the initialization (the global RNG is left as it was)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context", "n_layer", "n_head", "n_kv_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"LlamaSpec.{name} must be a positive int; got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} must be divisible by n_head {self.n_head}")
        if self.n_head % self.n_kv_head:
            raise ValueError(
                f"n_head {self.n_head} must be divisible by n_kv_head {self.n_kv_head}"
            )

    @property
    def intermediate_size(self) -> int:
        """SwiGLU hidden width: 8/3 of ``n_embd``, rounded up to a multiple of 8."""
        return -(-(8 * self.n_embd) // 24) * 8

    @staticmethod
    def kv_heads_for(n_head: int) -> int:
        """The app's key/value heads for ``n_head`` query heads (see the module docstring)."""
        return n_head // 2 if n_head % 2 == 0 else n_head


class Llama(nn.Module):
    """``LlamaForCausalLM`` (in ``self.hf``) with the GPT's call signature."""

    def __init__(self, config: LlamaSpec) -> None:
        super().__init__()
        if transformers_missing():
            raise ImportError(f"--model llama needs transformers: {INSTALL_TRANSFORMERS}")
        from transformers import LlamaConfig, LlamaForCausalLM

        self.config = config
        hf_config = LlamaConfig(
            vocab_size=config.vocab_size,
            hidden_size=config.n_embd,
            intermediate_size=config.intermediate_size,
            num_hidden_layers=config.n_layer,
            num_attention_heads=config.n_head,
            num_key_value_heads=config.n_kv_head,
            max_position_embeddings=config.context,
            tie_word_embeddings=False,
            use_cache=False,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            self.hf = LlamaForCausalLM(hf_config)

    @property
    def blocks(self) -> nn.ModuleList:
        """The decoder layers (a property: registering them twice would duplicate keys)."""
        return self.hf.model.layers

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def pretrained_files(self) -> dict[str, str]:
        """The JSON files ``save_pretrained`` writes beside the weights, by name: the model's
        config with the keys that method adds (``architectures``, by which serving tools pick
        the model class, and the weights' ``dtype``) and its generation config. The config
        object itself is left as it was. On a sharded model call it resharded: a forward
        under ``no_grad`` (an evaluation) leaves FSDP2's root unsharded in the compute dtype."""
        config = copy.deepcopy(self.hf.config)
        config.architectures = [type(self.hf).__name__]
        config.dtype = next(self.hf.parameters()).dtype
        return {
            "config.json": config.to_json_string(),
            "generation_config.json": self.hf.generation_config.to_json_string(),
        }

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if idx.shape[1] > self.config.context:
            raise ValueError(
                f"sequence length {idx.shape[1]} exceeds the context {self.config.context}"
            )
        logits = self.hf(input_ids=idx).logits
        loss = None
        if targets is not None:  # targets are already shifted, as for the GPT
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss
