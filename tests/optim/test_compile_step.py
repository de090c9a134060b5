"""The optimizers' ``step()`` inside ``torch.compile``: [Note: the optimizers' step under
torch.compile] in ``qshard.optim._options``. Traced, the 8- and 4-bit steps handed stale
addresses to their C kernels (a wrong first step, then a segmentation fault or a corrupted
heap) and the 1-bit optimizers failed in Inductor; now a compiled function runs the step
eagerly, bit for bit the eager step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qshard import optim as qoptim

# 4096 elements: quantized state (the C kernel's path) for the 8- and 4-bit optimizers.
CASES = [
    ("AdamW8bit", {}),
    ("Adam8bit", {}),
    ("Lion8bit", {}),
    ("SGD8bit", {"momentum": 0.9}),
    ("Adagrad8bit", {}),
    ("RMSprop8bit", {}),
    ("AdamW4bit", {}),
    ("OneBitAdam", {"freeze_step": 2}),
    ("ZeroOneAdam", {"var_freeze_step": 2}),
]


@pytest.mark.parametrize("name, kwargs", CASES, ids=[c[0] for c in CASES])
def test_a_compiled_function_steps_as_eager(name, kwargs):
    torch._dynamo.reset()
    cls = getattr(qoptim, name)
    torch.manual_seed(0)
    shapes = [(64, 64), (7,)]  # one quantized tensor and one fp32-state tensor
    eager = [nn.Parameter(torch.randn(s)) for s in shapes]
    compiled = [nn.Parameter(p.detach().clone()) for p in eager]
    opt_eager = cls(eager, lr=1e-2, **kwargs)
    opt_compiled = cls(compiled, lr=1e-2, **kwargs)
    step = torch.compile(lambda: opt_compiled.step())
    for _ in range(4):  # past the 1-bit optimizers' freeze
        for a, b in zip(eager, compiled, strict=True):
            g = torch.randn_like(a)
            a.grad, b.grad = g.clone(), g.clone()
        opt_eager.step()
        step()
        for a, b in zip(eager, compiled, strict=True):
            assert torch.equal(a, b)
    torch._dynamo.reset()


def test_a_compiled_training_step_with_an_8bit_optimizer():
    # The helper's reproducer: forward, backward and step in one compiled function; AdamW8bit
    # corrupted the heap. Forward and backward stay compiled (Inductor rounds differently from
    # eager), so the parameters are compared within rounding.
    torch._dynamo.reset()
    torch.manual_seed(0)
    x, y = torch.randn(16, 64), torch.randn(16, 64)

    def build():
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))

    models = [build(), build()]
    opts = [qoptim.AdamW8bit(m.parameters(), lr=1e-3) for m in models]

    def train_step(model, opt):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        return loss

    compiled = torch.compile(train_step)
    for _ in range(3):
        train_step(models[0], opts[0])
        compiled(models[1], opts[1])
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert opts[1].state[models[1][0].weight]["step"] == 3
    torch._dynamo.reset()
