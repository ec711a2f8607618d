"""Linear and expert weights kept 8-bit in memory, as the checkpoints users download store them:

- block FP8 (DeepSeek-V3's format: `quant_method: fp8`, `weight_block_size: [B0, B1]`): an FP8
  (e4m3) tensor `q` and float32 scales, one per B0 x B1 block, W[i, j] = q[i, j] * s[i // B0, j //
  B1], edge blocks ragged; weight-only: activations stay in the model's dtype;
- W8A8-INT8 (SGLang's `w8a8_int8`): an int8 tensor and a float32 scale per output row (a block of
  one row and every column), activations quantized to int8 per token at run time, the dot products
  in int32 (the fused CPU kernel `int8_linear`, or the same bits in plain PyTorch).

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

from dpserve import cpu_ops
from dpserve.layers.specs import FP8, INT8, QuantSpec
from dpserve.layers.specs import PER_ROW as PER_ROW  # where the kernels, tests and tools have always found it

QUANTIZED = (FP8, INT8)  # the dtypes of weights kept 8-bit
ROWS_PER_CHUNK = 256  # output rows widened at once on the CPU: a bounded scratch, never the whole weight


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


INT8_MAX = 127.0


def quantize(w: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """w [rows, cols] as `spec` keeps it (--quantization): each block's largest magnitude mapped to
    448 (FP8) or 127 (int8, rounded to nearest), edge blocks ragged. Returns (q, scales), W ~ q *
    scale of its block."""
    if spec.method == "w8a8_int8":
        scale = w.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / INT8_MAX
        return torch.round(w.float() / scale).clamp(-INT8_MAX, INT8_MAX).to(INT8), scale
    rows, cols = w.shape
    b0, b1 = spec.block
    r, c = math.ceil(rows / b0), math.ceil(cols / b1)
    padded = F.pad(w.float(), (0, c * b1 - cols, 0, r * b0 - rows)).view(r, b0, c, b1)
    scale = padded.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (padded / scale[:, None, :, None]).view(r * b0, c * b1)[:rows, :cols].to(FP8)
    return q, scale


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, row_block: torch.Tensor, col_block: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """q [rows, cols] (FP8 or int8) times its blocks' scales ([R, C], each row's and column's block) in
    float32, then cast to `dtype`: the values transformers computes from the dequantized checkpoint."""
    return (q.float() * scale[row_block[:, None], col_block[None, :]]).to(dtype)


@dataclass(frozen=True)
class QuantizedWeight:
    """One quantized weight ([rows, cols], or [experts, rows, cols] with `scale` [experts, R, C]);
    indexing takes one expert's."""

    q: torch.Tensor
    scale: torch.Tensor
    row_block: torch.Tensor
    col_block: torch.Tensor
    group: int = 0  # FP8 dots with activations quantized per 1 x group columns (0: weight-only)

    def __len__(self) -> int:
        return len(self.q)

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def __getitem__(self, e: int) -> QuantizedWeight:
        return QuantizedWeight(self.q[e], self.scale[e], self.row_block, self.col_block, self.group)


def quantized_linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T + bias for a quantized W on the CPU, in x's dtype: the fused CPU kernels where they
    run (a float32 bias), else their plain PyTorch forms (a GPU's: `quant_triton.linear`)."""
    fused = cpu_ops.usable(x)
    bias32 = None if bias is None else bias.float()
    if w.q.dtype == INT8:
        row_scale = w.scale[w.row_block, 0]  # W8A8-INT8: one block per row
        if fused:
            return torch.ops.dpserve_cpu.int8_linear(x, w.q, row_scale, bias32)
        return int8_linear(x, w.q, row_scale, bias)
    if fused:
        return torch.ops.dpserve_cpu.fp8_linear(x, w.q, w.scale, w.row_block, w.col_block, bias32)
    return fp8_linear(x, w, bias)


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., k] quantized to int8 per row (W8A8-INT8's activations): codes round(x * 127 / amax),
    half to even, and each row's scale amax / 127 [..., 1] in float32; a zero row has codes and
    scale 0. Plain PyTorch with no value read back: the GPU's fused kernels take the same codes."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    # A true division (a Python number over a tensor is a reciprocal times the number in PyTorch).
    inv = torch.where(amax > 0, torch.full_like(amax, INT8_MAX).div(amax), torch.zeros_like(amax))
    return torch.round(xf * inv).clamp(-INT8_MAX, INT8_MAX).to(INT8), amax / INT8_MAX


def int8_linear(
    x: torch.Tensor, q: torch.Tensor, row_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., k] quantized to int8 per token (`quantize_rows_int8`) times int8 q [n, k], exact
    integer dot products (float64 holds them), scaled by the token's and the row's scales in
    float32: the fused kernel's bits, in plain PyTorch."""
    xq, x_scale = quantize_rows_int8(x)
    dots = (xq.double() @ q.double().T).float()
    out = dots * x_scale * row_scale
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def fp8_linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T + bias for a block-FP8 W, widening ROWS_PER_CHUNK output rows at a time to x's dtype:
    the plain PyTorch form of the fused kernel `fp8_linear` (which widens a few rows at a time to
    float32 and sums in float32)."""
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


def fp8_dots(device: torch.device) -> bool:
    """Whether `device` multiplies FP8 by FP8 (CUDA sm89 and newer: Ada, Hopper, Blackwell)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def activation_group(spec: QuantSpec, first_col: int, device: torch.device) -> int:
    """The activation group of a weight whose rank's part starts `first_col` columns into a block
    (`QuantizedWeight.group`): DeepSeek's w8a8 recipe (activations in FP8 per 1 x block-width
    columns, FP8 dots) for block FP8 on a GPU with FP8 dots when the part's columns start on a block
    boundary and the block width is a power of two from 32 (a dot's K); 0 (weight-only) otherwise."""
    b1 = spec.block[1]
    usable = spec.method == "fp8" and first_col == 0 and b1 >= 32 and b1 & (b1 - 1) == 0
    return b1 if usable and fp8_dots(device) else 0


def kernels_used(model: torch.nn.Module, spec: QuantSpec, device: torch.device) -> str:
    """Which kernels multiply `model`'s 8-bit weights on `device`, and how many weights each: what
    the start-up log says."""
    if device.type == "cpu":
        return "the fused CPU kernels (plain PyTorch where none compiled)"
    if spec.method == "w8a8_int8":
        return (
            "Triton GEMMs and fused MoE: activations quantized to int8 per token, int8 dots summed in int32"
        )
    if not fp8_dots(device):
        return (
            f"Triton GEMMs and fused MoE, weight-only: FP8 tiles widened in the kernel (this GPU, sm"
            f"{''.join(map(str, torch.cuda.get_device_capability(device)))}, has no FP8 dots)"
        )
    names = [(m, n) for m in model.modules() for n in quantized_weights_of(m)]
    dots = sum(1 for m, n in names if getattr(m, f"{n}_group"))
    return (
        f"Triton GEMMs and fused MoE: FP8 dots with activations quantized per 1 x {spec.block[1]} group "
        f"for {dots} of {len(names)} weights; weight-only for the {len(names) - dots} whose rank's part "
        "starts inside a block"
    )


def quantize_groups_fp8(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, k] in FP8 (e4m3) per 1 x `group` columns, as DeepSeek's w8a8 recipe quantizes
    activations: each group's largest magnitude (at least 1e-10) mapped to 448. Returns the codes
    [m, k] and the scales [m, ceil(k / group)] in float32, x ~ codes * the scale of its group.
    Plain PyTorch with no value read back (captured graphs run it)."""
    m, k = x.shape
    groups = -(-k // group)
    padded = F.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    scale = padded.abs().amax(dim=-1).clamp(min=1e-10) / FP8_MAX
    codes = (padded / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).view(m, groups * group)[:, :k]
    return codes.to(FP8), scale


def add_weight(module: torch.nn.Module, name: str, shape: tuple[int, ...], spec: QuantSpec | None) -> None:
    """`module.<name>`: an empty Parameter of `shape`, 8-bit with its scale table and block indices
    under `spec`, else in the default dtype (`<name>_scale` None)."""
    dtype = spec.dtype if spec else None
    setattr(module, name, torch.nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False))
    setattr(module, f"{name}_scale", None)
    if spec is not None:
        scale, row_block, col_block = block_tables(shape, spec.block)
        set_tables(module, name, scale, row_block, col_block)


def set_tables(
    module: torch.nn.Module,
    name: str,
    scale: torch.Tensor,
    row_block: torch.Tensor,
    col_block: torch.Tensor,
    group: int = 0,
) -> None:
    """Gives `module.<name>` its scale table, block indices and activation group (`QuantizedWeight`;
    at build, and as the loader draws them)."""
    setattr(module, f"{name}_scale", torch.nn.Parameter(scale, requires_grad=False))
    setattr(module, f"{name}_row_block", row_block)
    setattr(module, f"{name}_col_block", col_block)
    setattr(module, f"{name}_group", group)


def quantized_weight(module: torch.nn.Module, name: str) -> QuantizedWeight | None:
    """`module.<name>` with its scales; None when it is not quantized."""
    scale = getattr(module, f"{name}_scale", None)
    if scale is None:
        return None
    return QuantizedWeight(
        getattr(module, name),
        scale,
        getattr(module, f"{name}_row_block"),
        getattr(module, f"{name}_col_block"),
        getattr(module, f"{name}_group"),
    )


def quantized_weights_of(module: torch.nn.Module) -> list[str]:
    """The names of `module`'s own quantized weights."""
    return [
        n
        for n in WEIGHT_NAMES
        if getattr(module, n, None) is not None and quantized_weight(module, n) is not None
    ]
