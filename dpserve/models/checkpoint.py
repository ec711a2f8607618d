"""A checkpoint on disk as the loader and the front end read it: safetensors files, single or
sharded, and gpt-oss's MXFP4 tensors dequantized as they are read. Nothing of the model stack: the
front end checks a checkpoint's tensors before any rank starts without loading the layers."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

# The sixteen FP4 (E2M1) values by their 4-bit code: sign bit, two exponent bits, one mantissa bit.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_GROUP = 32  # values sharing one scale


class MXFP4Slice:
    """A tensor stored in MXFP4 as gpt-oss's checkpoints store their experts: `blocks` [E, out, G,
    16] uint8 (two FP4 codes per byte, the low nibble first) and `scales` [E, out, G] uint8 (a power
    of two per group of 32 values, biased by 127). Read as the dequantized [E, in = 32 G, out]
    float32 (transformers' layout for these tensors), dequantizing only the part asked for."""

    def __init__(self, blocks, scales):
        self.blocks, self.scales = blocks, scales

    def get_shape(self) -> list[int]:
        experts, out, groups, per_group = self.blocks.get_shape()
        return [experts, groups * per_group * 2, out]

    def __getitem__(self, idx) -> torch.Tensor:
        idx = (idx,) if isinstance(idx, slice) else tuple(idx)
        e, i, o = (*idx, *[slice(None)] * (3 - len(idx)))
        start, stop, _ = i.indices(self.get_shape()[1])
        g0, g1 = start // MXFP4_GROUP, -(-stop // MXFP4_GROUP)
        values = dequantize_mxfp4(self.blocks[e, o, g0:g1], self.scales[e, o, g0:g1])  # [E, out, in]
        first = g0 * MXFP4_GROUP
        return values[..., start - first : stop - first].transpose(1, 2)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[..., G, 16] uint8 codes and [..., G] uint8 scales -> [..., 32 G] float32 (exact)."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # low nibble first
    values = lut[codes].flatten(-3)  # [..., G * 32]
    exponents = (scales.to(torch.int32) - 127).repeat_interleave(MXFP4_GROUP, dim=-1)
    return torch.ldexp(values, exponents.float())


class CheckpointReader:
    """A Hugging Face safetensors checkpoint, single-file or sharded; files opened lazily and only
    the slices asked for read."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            self.file_of = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(self.dir.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(
                    f"no weights in {self.dir}: expected *.safetensors files (or model.safetensors.index.json)"
                )
            self.file_of = {}
            for f in files:
                with safe_open(f, "pt") as h:
                    self.file_of.update(dict.fromkeys(h.keys(), f.name))
        # MXFP4 tensors (gpt-oss's experts) read by the name of the tensor they dequantize to.
        self.mxfp4 = {
            name.removesuffix("_blocks"): name
            for name in self.file_of
            if name.endswith("_blocks") and name.removesuffix("_blocks") + "_scales" in self.file_of
        }
        self.file_of |= {name: self.file_of[blocks] for name, blocks in self.mxfp4.items()}
        self._handles: dict[str, object] = {}

    def stored_name(self, name: str) -> str:
        """The tensor on disk that `name` reads (an MXFP4 tensor's blocks)."""
        return self.mxfp4.get(name, name)

    def slice(self, name: str):
        if name not in self.file_of:
            raise KeyError(f"tensor {name!r} not found in checkpoint {self.dir}")
        if name in self.mxfp4:
            return MXFP4Slice(self._raw_slice(name + "_blocks"), self._raw_slice(name + "_scales"))
        return self._raw_slice(name)

    def _raw_slice(self, name: str):
        fname = self.file_of[name]
        if fname not in self._handles:
            self._handles[fname] = safe_open(self.dir / fname, "pt")
        return self._handles[fname].get_slice(name)

    def offsets(self, fname: str) -> dict[str, int]:
        """Where each tensor of file `fname` starts in it (from its header)."""
        with open(self.dir / fname, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        return {k: v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}

    def close(self) -> None:
        self._handles.clear()
