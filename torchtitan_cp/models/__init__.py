"""Hybrid KDA / GDN / softmax-attention decoder on torchtitan's module and config system."""

from torchtitan_cp.models.context import SequenceContext
from torchtitan_cp.models.hybrid.decoder import HybridBlock, HybridDecoder, parse_layer_pattern
from torchtitan_cp.models.hybrid.flavors import FLAVORS, model_config, model_spec
from torchtitan_cp.models.recipe import recipe_model_spec

__all__ = [
    "FLAVORS",
    "HybridBlock",
    "HybridDecoder",
    "SequenceContext",
    "model_config",
    "model_spec",
    "parse_layer_pattern",
    "recipe_model_spec",
]
