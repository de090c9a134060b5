"""A small, readable GPT: the model ``qshard train`` trains and the ZeRO++ tests shard.

nanoGPT-shaped: token + learned position embeddings, a stack of pre-norm transformer
:class:`Block` s in ``model.blocks`` (an ``nn.ModuleList``, so ``fully_shard`` can be applied per
block), a final LayerNorm and a linear head. Initialization is deterministic from
``GPTConfig.seed`` and independent of the global RNG, so every rank (and every run) builds the
same weights without coordinating.

Head tying: with ``tie_head=True`` the head reuses the token embedding matrix (fewer parameters,
the usual GPT-2 choice). Tying is refused together with ``stable_embedding=True``: the stable
embedding normalizes its output and is meant to be kept in 32-bit optimizer state, which does not
fit a matrix that is also the output projection. Under FSDP a tied weight must live in the root
unit (shard the blocks first, then the root), which :func:`qshard.zeropp.shard` does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPT", "Block", "GPTConfig"]


@dataclass(frozen=True, kw_only=True, slots=True)
class GPTConfig:
    """Shape and initialization of a :class:`GPT`."""

    vocab_size: int = 256
    """Number of token ids; 256 for the byte-level corpus of ``qshard train``."""
    context: int = 128
    """Maximum sequence length (size of the position embedding)."""
    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide ``n_embd``."""
    n_embd: int = 256
    """Width of the residual stream."""
    mlp_ratio: int = 4
    """Hidden width of the MLP as a multiple of ``n_embd``."""
    dropout: float = 0.0
    """Dropout probability on attention, MLP and embeddings (0 keeps training deterministic)."""
    bias: bool = True
    """Whether Linear and LayerNorm layers carry a bias."""
    tie_head: bool = True
    """Reuse the token embedding matrix as the output head (see the module docstring)."""
    stable_embedding: bool = False
    """Use :class:`qshard.nn.StableEmbedding` for tokens (layer-normed, for 8-bit optimizers)."""
    seed: int = 0
    """Seed of the deterministic initialization."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context", "n_layer", "n_head", "n_embd", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int; got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.n_embd must be divisible by n_head; got n_embd {self.n_embd}, "
                f"n_head {self.n_head} (try n_embd {self.n_head * max(1, self.n_embd // self.n_head)})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1); got {self.dropout}")
        if self.tie_head and self.stable_embedding:
            raise ValueError(
                "GPTConfig: stable_embedding=True cannot be combined with tie_head=True; "
                "set tie_head=False to use StableEmbedding"
            )

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # (b, t, c) -> (b, heads, t, head_dim)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.n_embd
        self.fc = nn.Linear(config.n_embd, hidden, bias=config.bias)
        self.proj = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x), approximate="tanh")))


class Block(nn.Module):
    """One pre-norm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_mlp = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


def _token_embedding(config: GPTConfig) -> nn.Module:
    if not config.stable_embedding:
        return nn.Embedding(config.vocab_size, config.n_embd)
    try:
        # Imported lazily: qshard.nn is optional for the plain model.
        from qshard.nn import StableEmbedding
    except ImportError as exc:
        raise ImportError(
            "GPTConfig.stable_embedding=True needs qshard.nn.StableEmbedding, which this "
            "install does not provide; set stable_embedding=False"
        ) from exc
    return StableEmbedding(config.vocab_size, config.n_embd)


class GPT(nn.Module):
    """A decoder-only transformer over token ids.

    ``forward(idx, targets=None)`` takes ``idx`` of shape ``(batch, time)`` with
    ``time <= config.context`` and returns ``(logits, loss)``: logits of shape
    ``(batch, time, vocab_size)`` and the mean cross-entropy against ``targets`` (``None`` when
    no targets are given).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = _token_embedding(config)
        self.pos_emb = nn.Embedding(config.context, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_head:
            self.head.weight = self.tok_emb.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialize every weight from ``config.seed`` (GPT-2 scheme), leaving the global RNG
        untouched: N(0, 0.02) for linear and embedding weights, residual projections scaled by
        1/sqrt(2 * n_layer), zeros for biases, ones/zeros for LayerNorm; a StableEmbedding
        keeps its Xavier-uniform scheme."""
        gen = torch.Generator(device="cpu").manual_seed(self.config.seed)
        resid_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        seen: set[int] = set()
        for name, param in self.named_parameters():
            if id(param) in seen:  # a tied head is initialized once, as the embedding
                continue
            seen.add(id(param))
            if name.endswith("bias"):
                param.zero_()
            elif ".ln_" in name or name.startswith("ln_") or param.dim() == 1:
                param.fill_(1.0)
            elif name == "tok_emb.weight" and self.config.stable_embedding:
                # StableEmbedding's own scheme (Xavier uniform), drawn from the seeded generator.
                value = torch.empty(param.shape, dtype=torch.float32)
                nn.init.xavier_uniform_(value, generator=gen)
                param.copy_(value.to(device=param.device, dtype=param.dtype))
            else:
                std = resid_std if name.endswith("proj.weight") else 0.02
                value = torch.empty(param.shape, dtype=torch.float32).normal_(
                    0.0, std, generator=gen
                )
                param.copy_(value.to(device=param.device, dtype=param.dtype))

    def num_params(self, *, exclude_position: bool = False) -> int:
        """Number of distinct parameters (a tied head counted once)."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_position:
            n -= self.pos_emb.weight.numel()
        return n

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        _, t = idx.shape
        if t > self.config.context:
            raise ValueError(f"sequence length {t} exceeds GPTConfig.context {self.config.context}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss
