"""[Note: launch on the tensors' device]: Triton launches on the *current* CUDA device, so a
tensor on another GPU needs the dispatch layer to make its device current. Needs two GPUs
(skipped otherwise; nothing here can run in the interpreter, which has no devices)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("triton", reason="the GPU kernels need triton (pip install qshard[gpu])")

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
)


def test_kernels_run_on_the_tensors_gpu_not_the_current_one():
    from qshard import quant
    from qshard.optim import AdamW8bit

    torch.cuda.set_device(0)
    x = torch.randn(4099, generator=torch.Generator().manual_seed(0)) * 3
    q0 = quant.quantize_blockwise(x.to("cuda:0"), bits=8)
    q1 = quant.quantize_blockwise(x.to("cuda:1"), bits=8)
    assert torch.equal(q0.codes.cpu(), q1.codes.cpu())
    assert torch.equal(quant.dequantize_blockwise(q1).cpu(), quant.dequantize_blockwise(q0).cpu())
    signs = quant.pack_signs(x.to("cuda:1"))
    assert torch.equal(signs.cpu(), quant.pack_signs(x.to("cuda:0")).cpu())
    # an 8-bit optimizer over a model spread on two GPUs (device_map="auto" style)
    params = []
    for d in ("cuda:0", "cuda:1"):
        torch.manual_seed(0)
        params.append(nn.Parameter(torch.randn(256, 256, device=d)))
    opt = AdamW8bit(params, lr=1e-2)
    for _ in range(3):
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
    assert torch.cuda.current_device() == 0
    assert torch.equal(params[0].detach().cpu(), params[1].detach().cpu())
