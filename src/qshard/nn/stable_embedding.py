"""StableEmbedding: the embedding layer of the 8-bit-optimizers paper (Dettmers et al. 2022,
section 2.3), which keeps training with 8-bit optimizers stable for models with word embeddings.

Three changes from ``nn.Embedding``: Xavier-uniform initialisation (smaller initial variance),
a LayerNorm on the output computed in fp32 whatever the module's dtype, and 32-bit optimizer
state for the embedding weight in every qshard 8-bit optimizer (registered by *name*, so it
survives FSDP2's parameter replacement and checkpointing; see ``qshard.optim._overrides``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qshard.optim._overrides import register_full_precision_state

__all__ = ["StableEmbedding"]


class StableEmbedding(nn.Embedding):
    """``nn.Embedding`` with Xavier-uniform init, an fp32 LayerNorm on its output, and 32-bit
    optimizer state for ``weight``.

    Args: as ``nn.Embedding`` (``num_embeddings``, ``embedding_dim``, ``padding_idx``,
    ``max_norm``, ``norm_type``, ``scale_grad_by_freq``, ``sparse``, ``device``, ``dtype``;
    ``_weight``/``_freeze`` keyword-only, for ``StableEmbedding.from_pretrained``, which keeps
    the given table as ``nn.Embedding.from_pretrained`` does and starts a fresh LayerNorm).
    The output has the weight's dtype; the LayerNorm runs in fp32 on the fp32 lookup. Its
    affine parameters are made in the weight's dtype (``dtype=``, or the given table's), and a
    module-wide cast (``.half()``, ``.to(bf16)``) casts them like every other parameter (FSDP2
    wants one dtype per unit); they are upcast for the computation, so the normalisation stays
    fp32. ``reset_parameters`` re-initialises the LayerNorm too (meta-device
    init: ``to_empty`` then ``reset_parameters``). The qshard optimizers refuse sparse gradients,
    so use ``sparse=True`` only with an optimizer that takes them.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        _weight: Tensor | None = None,
        _freeze: bool = False,
    ) -> None:
        super().__init__(
            num_embeddings,
            embedding_dim,
            padding_idx=padding_idx,
            max_norm=max_norm,
            norm_type=norm_type,
            scale_grad_by_freq=scale_grad_by_freq,
            sparse=sparse,
            _weight=_weight,
            _freeze=_freeze,
            device=device,
            dtype=dtype,
        )
        # the LayerNorm's affine parameters in the weight's dtype: one dtype per module, as
        # FSDP2 wants of a unit (made in fp32 beside a bf16 weight, dtype=torch.bfloat16 gave a
        # unit FSDP2 refused at the first forward); upcast in forward all the same
        self.norm = nn.LayerNorm(embedding_dim, device=self.weight.device, dtype=self.weight.dtype)
        register_full_precision_state(self, "weight")

    def reset_parameters(self) -> None:
        nn.init.xavier_uniform_(self.weight)
        self._fill_padding_idx_with_zero()
        if "norm" in self._modules:  # absent while nn.Embedding.__init__ runs
            self.norm.reset_parameters()

    def forward(self, input: Tensor) -> Tensor:
        emb = F.embedding(
            input,
            self.weight,
            self.padding_idx,
            self.max_norm,
            self.norm_type,
            self.scale_grad_by_freq,
            self.sparse,
        )
        n = self.norm
        w = None if n.weight is None else n.weight.float()
        b = None if n.bias is None else n.bias.float()
        return F.layer_norm(emb.float(), n.normalized_shape, w, b, n.eps).to(self.weight.dtype)
