"""The weight loader reads a sharded checkpoint file by file, each in on-disk order, whatever order
the model lists its entries in; parts, padding and casts land where they belong."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from dpserve.models import loader
from dpserve.models.loader import CheckpointReader, Weight, load_bytes, load_weights


def test_reads_batched_per_file_in_disk_order(tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randn(6, 4, generator=g) for i in range(6)}
    shards = {"b.safetensors": ["t0", "t3", "t4"], "a.safetensors": ["t5", "t1", "t2"]}
    for fname, names in shards.items():
        save_file({n: tensors[n] for n in names}, str(tmp_path / fname))
    index = {"weight_map": {n: f for f, names in shards.items() for n in names}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    dest = {n: torch.empty(6, 4, dtype=torch.bfloat16) for n in tensors}
    half = torch.empty(3, 4)  # rows 3..5 of t2
    padded = torch.empty(4, 4)  # rows 4..7 of t1: two past its end, zeros
    weights = [Weight(n, dest[n]) for n in ("t4", "t1", "t0", "t5", "t3", "t2")]
    weights += [Weight("t2", half, 0, 1), Weight("t1", padded, 0, 1, pad=True)]
    reads = []
    original = CheckpointReader.slice
    monkeypatch.setattr(CheckpointReader, "slice", lambda r, name: reads.append(name) or original(r, name))
    load_weights(weights, tmp_path, show_progress=False)
    # safetensors lays a file's tensors out sorted by name: a file's reads go in that order.
    assert reads == ["t1", "t1", "t2", "t2", "t5", "t0", "t3", "t4"]
    for n, t in tensors.items():
        assert torch.equal(dest[n], t.to(torch.bfloat16)), n
    assert torch.equal(half, tensors["t2"][3:]) and torch.equal(padded[:2], tensors["t1"][4:])
    assert not padded[2:].any()
    assert load_bytes(weights) == 6 * 6 * 4 * 2 + 3 * 4 * 4 + 4 * 4 * 4
    assert loader.read_order(weights, CheckpointReader(tmp_path))[0][0].name == "t1"
