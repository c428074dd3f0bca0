"""The short causal depthwise convolution: local kernels (torch, fla), custom ops and its
context-parallel history (halo) exchange."""
