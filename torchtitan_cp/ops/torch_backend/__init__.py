"""Pure-PyTorch kernels (CPU or any device; autograd backward)."""

from .conv import causal_conv1d_torch
from .delta_rule import chunk_delta_rule_torch, delta_rule_final_states_torch

__all__ = ["causal_conv1d_torch", "chunk_delta_rule_torch", "delta_rule_final_states_torch"]
