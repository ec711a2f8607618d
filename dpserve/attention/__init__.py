"""Attention backends over the paged KV pool (design section 9)."""

from __future__ import annotations

from dpserve.attention.backend import AttentionBackend


def make_backend(name: str) -> AttentionBackend:
    """The backend behind `--attention-backend` (already resolved from auto)."""
    if name == "triton":
        from dpserve.attention.triton_backend import TritonBackend  # imports Triton only when chosen

        return TritonBackend()
    if name == "sdpa":
        from dpserve.attention.sdpa import SdpaBackend

        return SdpaBackend()
    raise ValueError(f"unknown attention backend {name!r}")
