"""Parameter initialisation helpers shared by the model's layers."""

from __future__ import annotations

from functools import partial

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
