"""torchtitan 0.3.0's Qwen3.5 through this recipe: the model, HF folders, parallelize.

torchtitan 0.3.0's qwen3_5 package imports its FSDP code, which needs torch >= 2.14: importing
this package says so in one line instead of an ImportError inside torchtitan (the hybrid models
need only 2.11).
"""

from torchtitan_cp import compat

compat.require_torch(compat.TRAINER_TORCH_FLOOR, "Qwen3.5 (torchtitan 0.3.0's qwen3_5)")
