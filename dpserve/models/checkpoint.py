"""Reads (slices of) tensors from a Hugging Face safetensors checkpoint, single-file or sharded."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open


class CheckpointReader:
    """Each rank opens the files lazily and reads only the slices it asks for."""

    def __init__(self, model_dir: str | Path, dtype: torch.dtype):
        self.dir = Path(model_dir)
        self.dtype = dtype
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            self.file_of = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(self.dir.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors files in {self.dir}")
            self.file_of = {}
            for f in files:
                with safe_open(f, "pt") as h:
                    self.file_of.update(dict.fromkeys(h.keys(), f.name))
        self._handles: dict[str, object] = {}

    def _slice(self, name: str):
        if name not in self.file_of:
            raise KeyError(f"tensor {name!r} not found in checkpoint {self.dir}")
        fname = self.file_of[name]
        if fname not in self._handles:
            self._handles[fname] = safe_open(self.dir / fname, "pt")
        return self._handles[fname].get_slice(name)

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self._slice(name)[:].to(dtype or self.dtype)

    def get_shard(self, name: str, dim: int, index: int, count: int, dtype: torch.dtype | None = None):
        """Reads part `index` of `count` equal parts of `name` along `dim`."""
        sl = self._slice(name)
        size = sl.get_shape()[dim]
        if size % count:
            raise ValueError(f"{name}: dimension {dim} of size {size} is not divisible into {count} shards")
        step = size // count
        idx = [slice(None)] * len(sl.get_shape())
        idx[dim] = slice(index * step, (index + 1) * step)
        return sl[tuple(idx)].to(dtype or self.dtype)

    def get_rows(self, name: str, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) of a 2-D tensor, zero-padded where `end` runs past the last row."""
        sl = self._slice(name)
        rows, cols = sl.get_shape()
        out = torch.zeros(end - start, cols, dtype=self.dtype)
        stop = min(end, rows)
        if stop > start:
            out[: stop - start] = sl[start:stop].to(self.dtype)
        return out

    def close(self) -> None:
        self._handles.clear()
