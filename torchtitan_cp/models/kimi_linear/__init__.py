"""Kimi Linear (KDA + MLA + MoE) on torchtitan's modules and this recipe's KDA mixer."""
