"""The update math of every 8-bit optimizer as pure per-parameter functions on fp32 tensors.

Each function updates ``param`` and the (dequantized) states in place and touches nothing else;
the optimizers decide how the states are stored. The operation order follows the
single-tensor ``torch.optim`` implementations (``lerp`` for Adam's first moment, ``addcmul``
for the second, ``addcdiv`` for the step) so that, with fp32 states, results match
``torch.optim`` to float rounding (the fp32-state path and fp64 parameters use them). The fused
C kernel in :mod:`qshard.optim._kernels` evaluates the same expressions as separate fp32
operations; :func:`kernel8_update` is that order in torch, which the 8-bit optimizers' torch path
runs for fp32 parameters, so it writes the kernel's bits ([Note: the kernel's order]).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__: list[str] = []  # private module


def adam_update(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
) -> None:
    """Adam (L2 weight decay added to the gradient) or AdamW (``decoupled``: decay the weight)."""
    if decoupled:
        param.mul_(1.0 - lr * weight_decay)
    elif weight_decay != 0.0:
        grad = grad.add(param, alpha=weight_decay)
    exp_avg.lerp_(grad, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    step_size = lr / (1.0 - beta1**step)
    bc2_sqrt = math.sqrt(1.0 - beta2**step)
    denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def adam_hparams(
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    inverse_bc2: bool,
) -> list[float]:
    """The 10 hyperparameters of the fused Adam kernels (8- and 4-bit): lr, beta1, beta2, eps,
    L2 weight decay, step size, the bias correction of v, decoupled decay factor, 1 - beta1,
    1 - beta2, in double (rounded to fp32 where used). The bias correction is
    ``sqrt(1 - beta2^step)`` (divided by; the 8-bit kernel) or with ``inverse_bc2`` its
    reciprocal (multiplied by; the 4-bit kernels)."""
    bc2 = math.sqrt(1.0 - beta2**step)
    return [
        lr,
        beta1,
        beta2,
        eps,
        0.0 if decoupled else weight_decay,
        lr / (1.0 - beta1**step),
        1.0 / bc2 if inverse_bc2 else bc2,
        1.0 - lr * weight_decay if decoupled else 1.0,
        1.0 - beta1,
        1.0 - beta2,
    ]


def lion_update(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
) -> None:
    """Lion (Chen et al. 2023): sign of an interpolated momentum, decoupled weight decay."""
    param.mul_(1.0 - lr * weight_decay)
    direction = exp_avg.mul(beta1).add_(grad, alpha=1.0 - beta1)
    # torch.sign(NaN) is 0: a NaN gradient would leave the weight finite and its state NaN,
    # freezing it silently. NaN stays NaN here, as in the fused kernels.
    param.add_(torch.where(direction.isnan(), direction, torch.sign(direction)), alpha=-lr)
    exp_avg.mul_(beta2).add_(grad, alpha=1.0 - beta2)


def sgd_update(
    param: Tensor,
    grad: Tensor,
    momentum_buffer: Tensor | None,
    *,
    first_step: bool,
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
) -> None:
    """SGD with optional momentum/Nesterov; the buffer starts as the first gradient (torch)."""
    if weight_decay != 0.0:
        grad = grad.add(param, alpha=weight_decay)
    if momentum_buffer is not None:
        if first_step:
            momentum_buffer.copy_(grad)
        else:
            momentum_buffer.mul_(momentum).add_(grad, alpha=1.0 - dampening)
        grad = grad.add(momentum_buffer, alpha=momentum) if nesterov else momentum_buffer
    param.add_(grad, alpha=-lr)


def rmsprop_update(
    param: Tensor,
    grad: Tensor,
    square_avg: Tensor,
    momentum_buffer: Tensor | None,
    *,
    lr: float,
    alpha: float,
    eps: float,
    weight_decay: float,
    momentum: float,
) -> None:
    """RMSprop (uncentered), optional momentum buffer."""
    if weight_decay != 0.0:
        grad = grad.add(param, alpha=weight_decay)
    square_avg.mul_(alpha).addcmul_(grad, grad, value=1.0 - alpha)
    avg = square_avg.sqrt().add_(eps)
    if momentum_buffer is not None:
        momentum_buffer.mul_(momentum).addcdiv_(grad, avg)
        param.add_(momentum_buffer, alpha=-lr)
    else:
        param.addcdiv_(grad, avg, value=-lr)


def adagrad_update(
    param: Tensor,
    grad: Tensor,
    state_sum: Tensor,
    *,
    step: int,
    lr: float,
    lr_decay: float,
    eps: float,
    weight_decay: float,
) -> None:
    """Adagrad with optional learning-rate decay."""
    if weight_decay != 0.0:
        grad = grad.add(param, alpha=weight_decay)
    clr = lr / (1.0 + (step - 1) * lr_decay)
    state_sum.addcmul_(grad, grad, value=1.0)
    std = state_sum.sqrt().add_(eps)
    param.addcdiv_(grad, std, value=-clr)


# [Note: the kernel's order] The 8-bit optimizers' torch path (no C kernel: no compiler,
# QSHARD_NO_KERNELS=1, a CPU the kernel does not serve) used to run the torch.optim-ordered
# functions above on the decoded states; the kernel evaluates each update as separate fp32
# operations with fp32 hyperparameters (its `_kernel_hparams`), so the two paths differed by
# rounding: ~1 ulp in the parameters after a step and now and then a code, and a data-parallel
# replica on a node without the kernel drifted from the others. `kernel8_update` is the
# kernel's scalar loop (`step_blocks` in qshard.optim._kernels) written in torch: the same
# operations in the same order (each torch elementwise op is one correctly rounded fp32
# operation; the square root goes through fp64, which rounds it correctly as the kernel's
# sqrtf does), so the torch path writes the kernel's bits (tested), as the 4-bit optimizers'
# reference does (qshard.optim._qstate4.adam4bit_reference). For fp32 parameters only, the
# ones a kernel could have stepped: it is 2-3x slower than the torch.optim-ordered functions
# (separate passes, the square root through fp64), and bf16 parameters on a CPU always take the
# torch path, so they keep the faster one.

_KIND_ADAM, _KIND_LION, _KIND_SGD, _KIND_RMSPROP, _KIND_ADAGRAD = range(5)  # _kernels.KIND_*


def f32(x: float) -> float:
    """``x`` rounded to fp32 (a hyperparameter as the kernels read it)."""
    return float(torch.tensor(x, dtype=torch.float32))


def _sqrt32(x: Tensor) -> Tensor:
    """The correctly rounded fp32 square root (torch's vectorised one can be 1 ulp off)."""
    return x.double().sqrt().float()


def kernel8_update(
    kind: int, p: Tensor, g: Tensor, states: list[Tensor], hp: list[float], *, first_step: bool
) -> None:
    """One fp32 update of ``p`` and ``states`` in place, in the kernel's order ([Note: the
    kernel's order]); ``g`` already canonical where the rounding rule says so, ``hp`` the
    optimizer's ``_kernel_hparams`` (rounded to fp32 here, as the kernel reads them)."""
    h = [f32(x) for x in hp]
    s1 = states[0]
    if kind == _KIND_ADAM:  # in place where the order allows: the same operations
        _, _, b2, eps, wd, step_size, bc2s, decay, b1w, b2w = h
        s2 = states[1]
        if decay != 1.0:
            p.mul_(decay)
        elif wd != 0.0:
            g = g + wd * p
        t = torch.sub(g, s1)
        s1.add_(t.mul_(b1w))  # m = s1 + b1w * (g - s1)
        torch.mul(g, b2w, out=t)
        s2.mul_(b2).add_(t.mul_(g))  # v = s2 * b2 + (b2w * g) * g
        den = _sqrt32(s2).div_(bc2s).add_(eps)
        p.sub_(torch.div(s1, den, out=den).mul_(step_size))
    elif kind == _KIND_LION:
        lr, b1, b2, _, decay, b1w, b2w = h
        c = b1 * s1 + b1w * g
        sign = torch.sign(c)  # NaN stays NaN (the kernel's rule; torch's vectorised sign gives 0)
        p.copy_(p * decay - lr * torch.where(c.isnan(), c, sign))
        s1.copy_(b2 * s1 + b2w * g)
    elif kind == _KIND_SGD:
        lr, mom, _, wd, nesterov, damp = h
        if wd != 0.0:
            g = g + wd * p
        buf = g if first_step else s1 * mom + damp * g
        d = g + mom * buf if nesterov != 0.0 else buf
        p.copy_(p - lr * d)
        s1.copy_(buf)
    elif kind == _KIND_RMSPROP:
        lr, alpha, eps, wd, mom, aw = h
        if wd != 0.0:
            g = g + wd * p
        v = s1 * alpha + (aw * g) * g
        avg = _sqrt32(v) + eps
        if len(states) > 1:
            buf = states[1] * mom + g / avg
            p.copy_(p - lr * buf)
            states[1].copy_(buf)
        else:
            p.copy_(p - lr * (g / avg))
        s1.copy_(v)
    elif kind == _KIND_ADAGRAD:
        clr, eps, wd = h
        if wd != 0.0:
            g = g + wd * p
        total = s1 + g * g
        p.copy_(p - clr * (g / (_sqrt32(total) + eps)))
        s1.copy_(total)
    else:
        raise ValueError(f"unknown update kind {kind}")
