"""The fused CPU kernels of dpserve/csrc/cpu_ops.cpp against the plain-PyTorch forms they replace
(what a machine without a compiler runs), bit for bit: each intermediate the eager form rounds to the
tensors' dtype is rounded here too, and the sums and exps whose order or approximation would decide
a last bit are ATen's own (a greedy decode can follow a last bit); float32, bfloat16 and
float16, widths that are not multiples of the vector width, strided inputs. Decode attention is in
test_attention.py."""

from __future__ import annotations

import json

import pytest
import torch

from dpserve import cpu_ops
from dpserve.config import EngineConfig
from dpserve.cpu_ops import cpu_key
from dpserve.layers.mlp import silu_and_mul
from dpserve.layers.norm import rms_norm
from dpserve.layers.rotary import _inv_freq, rotate

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert cpu_ops.load(), "the fused CPU kernels did not build (a C++ compiler and ninja are needed)"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", [(1, 576), (16, 576), (5, 40), (300, 7168), (3, 1)])
def test_rms_norm_same_bits(dtype, rows, dim):
    g = torch.Generator().manual_seed(rows + dim)
    x = (torch.randn(rows, dim, generator=g) * 3).to(dtype)
    w = torch.randn(dim, generator=g).to(dtype)
    fused = torch.ops.dpserve_cpu.rms_norm(x, w, 1e-6)
    assert torch.equal(fused, rms_norm(x, w, 1e-6))
    assert torch.equal(torch.ops.dpserve_cpu.rms_norm(x[:, None], w, 1e-6), rms_norm(x[:, None], w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "pairs"])
@pytest.mark.parametrize("dim", [64, 40, 6])
def test_rotary_same_bits(dtype, interleaved, dim):
    inv, factor = _inv_freq(dim, {"rope_theta": 10000.0}, 512)
    freqs = torch.outer(torch.arange(512, dtype=torch.float), inv)
    table = (torch.cat((freqs.cos(), freqs.sin()), dim=-1) * factor).to(dtype)
    g = torch.Generator().manual_seed(dim)
    qkv = torch.randn(9, 7, dim, generator=g).to(dtype)
    x = qkv[:, :5]  # the query and key heads of a fused projection: strided rows
    positions = torch.randint(0, 512, (9,), generator=g)
    fused = torch.ops.dpserve_cpu.rotary(x, table, positions, interleaved)
    assert torch.equal(fused, rotate(x, table, positions, interleaved))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 3072), (16, 3072), (4, 2, 50), (3, 2)])
def test_silu_and_mul_same_bits(dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    gate_up = (torch.randn(*shape, generator=g) * 6).to(dtype)  # tails of the exp: far below -20
    gate_up.view(-1)[0] = -100.0
    fused = torch.ops.dpserve_cpu.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(fused, torch.nn.functional.silu(gate) * up)
    assert torch.equal(silu_and_mul(gate_up), fused)  # the MLP's own entry point runs the kernel


def test_dtype_auto_follows_the_cached_probe(tmp_path, monkeypatch):
    """`--dtype auto` on the CPU: a probe of this machine's bfloat16 and float32 GEMMs, run once and
    cached per CPU and torch version, decides; the cached verdict is what later starts read."""
    monkeypatch.setenv("DPSERVE_CACHE", str(tmp_path))
    fresh = EngineConfig(model_path="m", device="cpu").dtype
    cache = json.loads((tmp_path / "dtype_probe.json").read_text())
    ((key, times),) = cache.items()
    assert (
        key == f"torch{torch.__version__}-{cpu_key()}" and times["bfloat16_s"] > 0 and times["float32_s"] > 0
    )
    assert fresh == ("bfloat16" if times["bfloat16_s"] < times["float32_s"] else "float32")
    for bf16_s, f32_s, dtype in ((2.0, 1.0, "float32"), (1.0, 2.0, "bfloat16")):
        cache[key] = {"bfloat16_s": bf16_s, "float32_s": f32_s}
        (tmp_path / "dtype_probe.json").write_text(json.dumps(cache))
        assert EngineConfig(model_path="m", device="cpu").dtype == dtype
    assert EngineConfig(model_path="m", device="cpu", dtype="float16").dtype == "float16"  # asked: kept


@pytest.mark.parametrize("vocab", [301, 49152, 32005])
def test_token_bitmask_same_as_xgrammar(vocab):
    """The grammar's mask on the CPU: xgrammar's kernel's result, for masks that allow few tokens
    (whole words of zeros), many (words of ones) or any mix, on a subset of the rows."""
    import xgrammar as xgr

    from dpserve.grammar import apply_bitmask, token_bitmask

    g = torch.Generator().manual_seed(vocab)
    bitmask = token_bitmask(6, vocab)
    bitmask[1:] = torch.randint(-(2**31), 2**31 - 1, bitmask[1:].shape, dtype=torch.int32, generator=g)
    bitmask[2, : bitmask.shape[1] // 2] = 0
    bitmask[3] = 0
    bit = (vocab - 1) % 32
    bitmask[3, -1] = 1 << bit if bit < 31 else -(2**31)  # only the last token (int32's sign bit)
    rows = [0, 2, 3, 5]
    padded = torch.randn(6, vocab + 3, generator=g)  # the LM head's padded vocabulary, sliced
    logits, tail = padded[:, :vocab], padded[:, vocab:].clone()
    mine, theirs = logits, logits.clone()
    logits = logits.clone()
    apply_bitmask(mine, bitmask, rows)
    xgr.apply_token_bitmask_inplace(theirs, bitmask, indices=rows, backend="cpu")
    assert torch.equal(mine, theirs)
    assert torch.isfinite(mine[3]).sum() == 1 and torch.equal(mine[[1, 4]], logits[[1, 4]])
    assert torch.equal(padded[:, vocab:], tail)  # nothing written past the vocabulary
