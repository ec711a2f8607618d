"""Attention backends over the paged KV pool (docs/design.md, section 9)."""

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
    if name == "torch":
        from dpserve.attention.torch_backend import TorchBackend

        return TorchBackend()
    raise ValueError(f"unknown attention backend {name!r}")
