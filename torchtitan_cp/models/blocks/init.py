"""Parameter initialisation helpers shared by the model's layers."""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn
from torchtitan.models.common.linear import Linear

BASE_STD = 0.02


def linear_config(
    in_features: int, out_features: int, *, bias: bool = False, std: float = BASE_STD
) -> Linear.Config:
    """A torchtitan ``Linear`` config with a truncated-normal weight (±3σ) and a zero bias."""
    init = {"weight": partial(nn.init.trunc_normal_, std=std, a=-3 * std, b=3 * std)}
    if bias:
        init["bias"] = nn.init.zeros_
    return Linear.Config(
        in_features=in_features, out_features=out_features, bias=bias, param_init=init
    )


def linear(
    in_features: int, out_features: int, *, bias: bool = False, std: float = BASE_STD
) -> Linear:
    return linear_config(in_features, out_features, bias=bias, std=std).build()


def init_decay(A_log: nn.Parameter, dt_bias: nn.Parameter) -> None:
    """A learned decay ``-A·softplus(x + dt_bias)`` as Mamba-2 and GDN initialise it: A in
    [1, 16] (stored as ``A_log``), dt in [1e-3, 1e-1] log-uniform, floored at 1e-4 (stored as
    ``dt_bias``, its inverse softplus), so the initial per-token decays span short to long
    memories."""
    with torch.no_grad():
        A_log.copy_(torch.empty_like(A_log).uniform_(1, 16).log())
        dt = torch.exp(
            torch.empty_like(dt_bias).uniform_(math.log(1e-3), math.log(1e-1))
        ).clamp_min(1e-4)
        dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
