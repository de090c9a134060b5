"""The update math of every 8-bit optimizer as pure per-parameter functions on fp32 tensors.

Each function updates ``param`` and the (dequantized) states in place and touches nothing else;
the optimizers decide how the states are stored. The operation order follows the
single-tensor ``torch.optim`` implementations (``lerp`` for Adam's first moment, ``addcmul``
for the second, ``addcdiv`` for the step) so that, with fp32 states, results match
``torch.optim`` to float rounding. The fused C kernel in :mod:`qshard.optim._kernels` evaluates
the same expressions; tests hold the two to each other.
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
