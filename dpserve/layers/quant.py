"""Block-quantized FP8 weights kept 8-bit in memory (DeepSeek-V3's format: `quant_method: fp8`,
`weight_block_size: [B0, B1]`): an FP8 (e4m3) tensor `q` and float32 scales, one per B0 x B1 block,
W[i, j] = q[i, j] * s[i // B0, j // B1], edge blocks ragged.

A rank's part of a tensor need not start on a block boundary (tp splits of any size), and a fused
parameter (gate | up, q | k | v, every expert's w13) holds several parts: so a weight's scales are a
table of the blocks its parts touch, with each row's and column's block in it (`row_block`,
`col_block`): W[..., i, j] = q[..., i, j] * scale[..., row_block[i], col_block[j]]. The index
tables cost 4 bytes per row and column; the scales 4 bytes per block.

Which layers are built quantized is the model's build context (`quantized_weights`), as the
default dtype is: Linear and the MoE experts read it; a layer whose weight is read as a tensor
(MLA's absorbed kv_b_proj) stays in the model's dtype and is widened once at load.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
ROWS_PER_CHUNK = 256  # output rows widened at once on the CPU: a bounded scratch, never the whole weight


@dataclass(frozen=True)
class QuantSpec:
    """How a checkpoint's linear weights are kept: block FP8 with blocks of `block` (rows, columns),
    as stored (its quantization_config) or quantized at load (`online`: --quantization fp8)."""

    method: str  # fp8
    block: tuple[int, int]
    online: bool = False


_BUILDING: list[QuantSpec | None] = [None]


@contextlib.contextmanager
def quantized_weights(spec: QuantSpec | None) -> Iterator[None]:
    """Layers built inside keep their weights as `spec` stores them (None: the model's dtype)."""
    _BUILDING.append(spec)
    try:
        yield
    finally:
        _BUILDING.pop()


def building_spec() -> QuantSpec | None:
    return _BUILDING[-1]


def block_tables(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[torch.Tensor, ...]:
    """A quantized weight's scale table and its row and column block indices for `shape` ([..., rows,
    cols]) as if its parts started on block boundaries (the loader redraws them for the parts it
    reads): what the planner counts."""
    *lead, rows, cols = shape
    b0, b1 = block
    scale = torch.empty(*lead, math.ceil(rows / b0), math.ceil(cols / b1), dtype=torch.float32)
    row_block = torch.arange(rows, dtype=torch.long) // b0
    col_block = torch.arange(cols, dtype=torch.long) // b1
    return scale, row_block, col_block


FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [rows, cols] in block FP8 (--quantization fp8): each block's largest magnitude mapped to
    448, edge blocks ragged. Returns (q, scales), W ~ q * scale of its block."""
    rows, cols = w.shape
    b0, b1 = block
    r, c = math.ceil(rows / b0), math.ceil(cols / b1)
    padded = F.pad(w.float(), (0, c * b1 - cols, 0, r * b0 - rows)).view(r, b0, c, b1)
    scale = padded.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (padded / scale[:, None, :, None]).view(r * b0, c * b1)[:rows, :cols].to(FP8)
    return q, scale


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, row_block: torch.Tensor, col_block: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """q [rows, cols] (FP8) times its blocks' scales ([R, C], each row's and column's block) in
    float32, then cast to `dtype`: the values transformers computes from the dequantized checkpoint."""
    return (q.float() * scale[row_block[:, None], col_block[None, :]]).to(dtype)


@dataclass(frozen=True)
class BlockFP8:
    """One quantized weight ([rows, cols], or [experts, rows, cols] with `scale` [experts, R, C]);
    indexing takes one expert's."""

    q: torch.Tensor
    scale: torch.Tensor
    row_block: torch.Tensor
    col_block: torch.Tensor

    def __len__(self) -> int:
        return len(self.q)

    def __getitem__(self, e: int) -> BlockFP8:
        return BlockFP8(self.q[e], self.scale[e], self.row_block, self.col_block)


def fp8_linear(x: torch.Tensor, w: BlockFP8, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T + bias for a block-FP8 W, widening ROWS_PER_CHUNK output rows at a time to x's dtype."""
    rows = w.q.shape[0]
    out = x.new_empty(*x.shape[:-1], rows)
    for lo in range(0, rows, ROWS_PER_CHUNK):
        hi = min(lo + ROWS_PER_CHUNK, rows)
        part = dequantize(w.q[lo:hi], w.scale, w.row_block[lo:hi], w.col_block, x.dtype)
        out[..., lo:hi] = F.linear(x, part, None if bias is None else bias[lo:hi])
    return out


# A quantized weight `X` of a module has `X_scale` (a Parameter: the planner counts it), `X_row_block`
# and `X_col_block` beside it: these helpers are the one place that spells the names.
WEIGHT_NAMES = ("weight", "w13", "w2")  # Linear's, the MoE's experts'


def add_weight(module: torch.nn.Module, name: str, shape: tuple[int, ...], spec: QuantSpec | None) -> None:
    """`module.<name>`: an empty Parameter of `shape`, in block FP8 with its scale table and block
    indices under `spec`, else in the default dtype (`<name>_scale` None)."""
    setattr(
        module, name, torch.nn.Parameter(torch.empty(shape, dtype=FP8 if spec else None), requires_grad=False)
    )
    setattr(module, f"{name}_scale", None)
    if spec is not None:
        scale, row_block, col_block = block_tables(shape, spec.block)
        set_tables(module, name, scale, row_block, col_block)


def set_tables(
    module: torch.nn.Module, name: str, scale: torch.Tensor, row_block: torch.Tensor, col_block: torch.Tensor
) -> None:
    """Gives `module.<name>` its scale table and block indices (at build, and as the loader draws them)."""
    setattr(module, f"{name}_scale", torch.nn.Parameter(scale, requires_grad=False))
    setattr(module, f"{name}_row_block", row_block)
    setattr(module, f"{name}_col_block", col_block)


def fp8_weight(module: torch.nn.Module, name: str) -> BlockFP8 | None:
    """`module.<name>` with its scales; None when it is not quantized."""
    scale = getattr(module, f"{name}_scale", None)
    if scale is None:
        return None
    return BlockFP8(
        getattr(module, name),
        scale,
        getattr(module, f"{name}_row_block"),
        getattr(module, f"{name}_col_block"),
    )


def quantized_weights_of(module: torch.nn.Module) -> list[str]:
    """The names of `module`'s own block-FP8 weights."""
    return [
        n for n in WEIGHT_NAMES if getattr(module, n, None) is not None and fp8_weight(module, n) is not None
    ]
