"""dpserve: a compact LLM serving engine with DP attention for DeepSeek-style MoE models."""

from dpserve.engine.engine import Engine

__all__ = ["Engine"]
