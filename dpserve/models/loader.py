"""The weight loader: the one place that decides which part of which checkpoint tensor a rank reads.

A model lists where each of its parameters comes from as `Weight` entries (its `weights()`): the
checkpoint tensor's name, the destination (a parameter, or a view of the part of a fused one it
fills: the q/k/v rows of `qkv_proj`, one expert of `w13`), and the shard rule:

    Weight(name, dest)                      the whole tensor, replicated (norms, routers)
    Weight(name, dest, dim, index)          part `index` along `dim`, as large as `dest` (column and
                                            row parallel, heads, experts)
    Weight(name, dest, dim, index, pad=True) the same, zeros past the tensor's end (a vocabulary
                                            padded to a multiple of the ranks)
    Weight(..., part_size=n, transform=f)   a part of n elements along `dim` of the checkpoint's
                                            layout, then `f` of it (gpt-oss's fused experts:
                                            transposed, gate and up de-interleaved)

Layers know nothing of checkpoints; a new sharding (experts per rank) or a new tensor format is a
change here and in the models' tables only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from dpserve.layers.quant import (
    QUANTIZED,
    activation_group,
    dequantize,
    quantize,
    quantized_weights_of,
    set_tables,
)
from dpserve.layers.specs import INT8, PER_ROW, QuantSpec
from dpserve.models.checkpoint import CheckpointReader


@dataclass(frozen=True)
class Weight:
    name: str  # checkpoint tensor
    dest: torch.Tensor  # a parameter, or a view of the part of a fused parameter it fills
    dim: int | None = None  # None: replicated; else this rank's part along `dim`:
    index: int = 0  # elements [index * n, (index + 1) * n), n = dest.shape[dim]
    pad: bool = False  # zeros past the tensor's end instead of an error
    part_size: int | None = None  # elements of the part along `dim` (default: dest.shape[dim])
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None  # the part into dest's layout

    def origin(self) -> tuple[int, int]:
        """Where this rank's part starts in the checkpoint's [rows, cols] tensor."""
        if self.dim is None:
            return 0, 0
        start = self.index * (self.part_size or self.dest.shape[self.dim])
        return (start, 0) if self.dim == 0 else (0, start)

    def read(self, r: CheckpointReader) -> torch.Tensor:
        sl = r.slice(self.name)
        shape = tuple(sl.get_shape())
        if self.dim is None:
            part = sl[:]
        else:
            n = self.part_size or self.dest.shape[self.dim]
            start, stop = self.index * n, min((self.index + 1) * n, shape[self.dim])
            if stop - start < n and not self.pad:
                raise ValueError(
                    f"{self.name}: dimension {self.dim} of size {shape[self.dim]} has no part {self.index} "
                    f"of size {n}"
                )
            idx = [slice(None)] * len(shape)
            idx[self.dim] = slice(start, max(start, stop))
            part = sl[tuple(idx)]
            if stop - start < n:
                full = torch.zeros((*shape[: self.dim], n, *shape[self.dim + 1 :]), dtype=part.dtype)
                full.narrow(self.dim, 0, part.shape[self.dim]).copy_(part)
                part = full
        if self.transform is not None:
            part = self.transform(part)
        if part.shape != self.dest.shape:
            raise ValueError(
                f"{self.name}: the checkpoint's tensor {shape} gives {tuple(part.shape)} on this rank, "
                f"but the model's parameter is {tuple(self.dest.shape)}"
            )
        return part


def read_order(weights: list[Weight], reader: CheckpointReader) -> list[list[Weight]]:
    """The entries grouped by checkpoint file, each file's in the order of its tensors on disk:
    one sequential pass over each file."""
    by_file: dict[str, list[Weight]] = {}
    for w in weights:
        if w.name not in reader.file_of:
            raise KeyError(f"tensor {w.name!r} not found in checkpoint {reader.dir}")
        by_file.setdefault(reader.file_of[w.name], []).append(w)
    out = []
    for fname in sorted(by_file):
        offsets = reader.offsets(fname)
        out.append(sorted(by_file[fname], key=lambda w: offsets[reader.stored_name(w.name)]))
    return out


class BlockScales:
    """8-bit tensors (block FP8, per-row int8) as they are read: each rank's part with the scales of
    the blocks it touches (also when the part starts inside a block), widened for a destination in
    another dtype, or collected for a quantized one (`dpserve.layers.quant`) whose scale table and
    block indices are drawn once all its parts are read (`finish`)."""

    def __init__(self, spec: QuantSpec, model: torch.nn.Module):
        self.spec = spec
        # Each quantized weight by its storage: (module, name), and the parts read into it.
        self.targets = {
            getattr(m, name).untyped_storage().data_ptr(): (m, name)
            for m in model.modules()
            for name in quantized_weights_of(m)
        }
        self.parts: dict[int, list[tuple[int, int, int, int, int, torch.Tensor]]] = {}

    def scales(self, w: Weight, r: CheckpointReader) -> tuple[torch.Tensor, int, int]:
        """The scales of the blocks `w`'s part touches, and where the part starts in its first
        row and column block."""
        name = w.name + self.spec.scale_suffix
        if name not in r.file_of:
            raise ValueError(f"{w.name} is {self.spec.dtype} but the checkpoint has no {name}")
        rows, cols = r.slice(w.name).get_shape()
        b0, b1 = self.spec.block
        sl = r.slice(name)
        expected = (-(-rows // b0), -(-cols // b1))
        shape = tuple(sl.get_shape())
        if shape != expected and not (b1 == PER_ROW and shape == (rows,)):  # int8: [out] or [out, 1]
            source = "weight_block_size" if self.spec.method == "fp8" else self.spec.method
            raise ValueError(
                f"{name} has shape {shape}, but {w.name} {(rows, cols)} in {self.spec.describe()} "
                f"({source}) needs {expected}"
            )
        (row0, col0), (n, m) = w.origin(), w.dest.shape[-2:]
        rows_touched = slice(row0 // b0, -(-(row0 + n) // b0))
        if len(shape) == 1:
            return sl[rows_touched][:, None], row0 % b0, 0
        return sl[rows_touched, col0 // b1 : -(-(col0 + m) // b1)], row0 % b0, col0 % b1

    def load(self, w: Weight, part: torch.Tensor, r: CheckpointReader) -> torch.Tensor:
        """The part as its destination takes it: widened, or as it is with its scales kept for
        `finish`; an unquantized part for an 8-bit destination quantized here (--quantization), in
        blocks from its own first row and column."""
        if w.transform is not None or w.pad or part.dim() != 2:
            raise ValueError(f"{w.name}: an 8-bit tensor read with a transform, padding or {part.dim()} dims")
        if part.dtype == self.spec.dtype:
            scale, r0, c0 = self.scales(w, r)
        elif self.spec.online and part.is_floating_point() and part.dtype not in QUANTIZED:
            (part, scale), r0, c0 = quantize(part, self.spec), 0, 0
        else:
            raise ValueError(
                f"{w.name} is {part.dtype} in the checkpoint, but it is read as {self.spec.method} "
                f"({self.spec.dtype}): the checkpoint does not match its quantization"
            )
        if w.dest.dtype not in QUANTIZED:
            b0, b1 = self.spec.block
            rows = (r0 + torch.arange(part.shape[0])) // b0
            cols = (c0 + torch.arange(part.shape[1])) // b1
            return dequantize(part, scale, rows, cols, w.dest.dtype)
        q = self._target(w)
        offset = w.dest.storage_offset() - q.storage_offset()
        per_expert = q.shape[-2] * q.shape[-1]
        expert, row = divmod(offset, per_expert)
        if row % q.shape[-1] or w.dest.shape[-1] != q.shape[-1]:
            raise ValueError(f"{w.name}: a quantized weight is filled by whole rows")
        key = q.untyped_storage().data_ptr()
        self.parts.setdefault(key, []).append((expert, row // q.shape[-1], part.shape[0], r0, c0, scale))
        return part

    def _target(self, w: Weight) -> torch.Tensor:
        found = self.targets.get(w.dest.untyped_storage().data_ptr())
        if found is None:
            raise ValueError(f"{w.name}: 8-bit destination of no quantized layer")
        module, name = found
        return getattr(module, name)

    def finish(self) -> None:
        """Each quantized weight's scale table ([experts, ] blocks touched, in row order) and its
        rows' and columns' blocks in it; every expert's parts lie alike."""
        b0, b1 = self.spec.block
        for key, (module, name) in self.targets.items():
            q = getattr(module, name)
            parts = self.parts.get(key, [])
            experts = q.shape[0] if q.dim() == 3 else 1
            by_expert = [sorted((p for p in parts if p[0] == e), key=lambda p: p[1]) for e in range(experts)]
            layout = [(row, n, r0, c0, tuple(s.shape)) for _, row, n, r0, c0, s in by_expert[0]]
            sizes = [n for _, n, *_ in layout]
            starts = [sum(sizes[:i]) for i in range(len(sizes))]  # the parts, back to back
            if [row for row, *_ in layout] != starts or sum(sizes) != q.shape[-2]:
                raise ValueError(
                    f"{type(module).__name__}.{name}: its rows were not all read from 8-bit tensors"
                )
            if any(
                [(row, n, r0, c0, tuple(s.shape)) for _, row, n, r0, c0, s in e] != layout for e in by_expert
            ):
                raise ValueError(f"{type(module).__name__}.{name}: experts' parts differ in their blocks")
            if len({(c0, shape[1]) for *_, c0, shape in layout}) != 1:
                raise ValueError(f"{type(module).__name__}.{name}: parts start in different column blocks")
            row_block, base = [], 0
            for _, n, r0, _, shape in layout:
                row_block += [base + (r0 + k) // b0 for k in range(n)]
                base += shape[0]
            c0 = layout[0][3]
            tables = [torch.cat([s for *_, s in e]) for e in by_expert]
            device = q.device
            scale = torch.stack(tables) if q.dim() == 3 else tables[0]
            col_block = (c0 + torch.arange(q.shape[-1], device=device)) // b1
            group = activation_group(self.spec, c0, device)
            set_tables(
                module, name, scale.to(device), torch.tensor(row_block, device=device), col_block, group
            )


def load_bytes(weights: list[Weight]) -> int:
    """Bytes a rank's entries fill (what it reads, at its parameters' dtype): works on the meta device."""
    return sum(w.dest.numel() * w.dest.element_size() for w in weights)


@torch.no_grad()
def load_weights(
    weights: list[Weight], model_dir: str | Path, show_progress: bool, quantized: BlockScales | None = None
) -> None:
    """Reads every entry's part of the checkpoint into its destination (cast to its dtype), file by
    file in on-disk order; 8-bit tensors through `quantized` (their scales). On a GPU each part is staged in
    pinned memory and copied without blocking, the host reading the next part meanwhile; one
    synchronisation per file releases the staging buffers."""
    reader = CheckpointReader(model_dir)
    try:
        files = read_order(weights, reader)
        with tqdm(
            total=len(weights), desc="Loading weights", unit="tensor", disable=not show_progress
        ) as bar:
            for group in files:
                staged = []
                for w in group:
                    part = w.read(reader)
                    if part.dtype in QUANTIZED or w.dest.dtype in QUANTIZED:
                        if quantized is None:
                            hint = " (--quantization w8a8_int8 names SGLang's format)" * (part.dtype == INT8)
                            raise ValueError(
                                f"{w.name} is {part.dtype} in the checkpoint, but the model reads it as "
                                f"{w.dest.dtype}: its quantization_config does not say how it is stored{hint}"
                            )
                        part = quantized.load(w, part, reader)
                    if w.dest.is_cuda:
                        part = part.pin_memory()
                        staged.append(part)  # alive until its copy has run
                    w.dest.copy_(part, non_blocking=w.dest.is_cuda)
                    bar.update()
                if staged:
                    torch.cuda.synchronize()
        if quantized is not None:
            quantized.finish()
    finally:
        reader.close()
