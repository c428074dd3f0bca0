"""torchtitan 0.3.0's Qwen3.5 through this recipe: the model, HF folders, parallelize."""
