"""Reusable layers of the models: short convolution, gated norms, init, RoPE, flex attention."""
