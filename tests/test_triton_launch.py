"""Split-K decode compiles one kernel pair whatever the step's context lengths (issue 26, point 3).

The split count is a runtime argument of both decode kernels, not a constexpr: every new
context-length bucket used to JIT-compile a new pair while serving. A spy on the kernels' `run`
records the key Triton compiles a kernel under over 1,000 decode calls through the backend, at the
GPU's launch choices (132 SMs); most calls only record (the interpreter is too slow for 1,000), a
few run and are checked against a torch reference.
"""

from __future__ import annotations

import inspect
import random
from functools import partial

import pytest
import torch

from dpserve.attention import triton_kernels as tk
from dpserve.attention.backend import AttentionMetadata
from dpserve.attention.triton_backend import TritonBackend
from dpserve.triton_setup import INTERPRET

DEV = "cpu" if INTERPRET else "cuda"
KERNELS = (tk._decode_split_kernel, tk._decode_reduce_kernel)
MAX_LEN, MAX_BATCH = 8192, 64


def _compile_key(kernel, args: tuple, kwargs: dict) -> tuple:
    """What Triton (3.x) keys a compiled kernel on: the constexprs and launch options by value, and
    the other arguments by specialization unless listed in do_not_specialize: an int by whether it
    is 1 or divisible by 16, a tensor by 16-byte alignment (floats not at all)."""
    dns = getattr(kernel, "do_not_specialize", None) or getattr(kernel, "kwargs", {}).get("do_not_specialize")
    dns = set(dns or ())
    params = list(inspect.signature(kernel.fn).parameters.values())
    names = {p.name for p in params}
    bound = dict(zip((p.name for p in params), args, strict=False)) | kwargs
    key = []
    for i, p in enumerate(params):
        v = bound[p.name]
        if "constexpr" in str(p.annotation):
            key.append((p.name, v))
        elif p.name in dns or i in dns:
            continue
        elif isinstance(v, torch.Tensor):
            key.append((p.name, v.data_ptr() % 16 == 0))
        elif isinstance(v, int) and not isinstance(v, bool):
            key.append((p.name, v == 1, v % 16 == 0))
    key += sorted((k, v) for k, v in kwargs.items() if k not in names)  # num_warps, num_stages
    return tuple(key)


class Spy:
    """Wraps each decode kernel's `run`: records its compile key and grid; runs it when `execute`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.keys: dict[str, set[tuple]] = {k.fn.__name__: set() for k in KERNELS}
        self.splits: set[int] = set()
        self.execute = False
        for kernel in KERNELS:
            monkeypatch.setattr(kernel, "run", self._wrap(kernel, kernel.run))

    def _wrap(self, kernel, run):
        def spied(*args, grid, warmup, **kwargs):
            self.keys[kernel.fn.__name__].add(_compile_key(kernel, args, kwargs))
            if kernel is tk._decode_split_kernel:
                self.splits.add(grid[2])
            return run(*args, grid=grid, warmup=warmup, **kwargs) if self.execute else None

        return spied


def _reference(q, k, v, table, table_rows, lens, scale):
    """Plain softmax attention of each request's one query over its context, KV heads repeated."""
    group = q.shape[1] // k.shape[1]
    out = []
    for b, n in enumerate(lens):
        slots = table[table_rows[b], :n].long()
        kb = k[slots].repeat_interleave(group, 1).float()  # [n, heads, dk]
        vb = v[slots].repeat_interleave(group, 1).float()
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[b].float(), kb) * scale, -1)
        out.append(torch.einsum("hn,nhd->hd", p, vb))
    return torch.stack(out)


# (name, heads, kv_heads, key dim, value dim): GQA of 4 heads per KV head (no tl.dot), and MLA's form
# (one KV head, 16 heads: tl.dot; a 16 + 8 key dim whose values are its first 16 columns).
SHAPES = [("gqa", 8, 2, 16, 16), ("mla", 16, 1, 24, 16)]


@pytest.mark.parametrize("name,heads,kv_heads,lk,lv", SHAPES, ids=[s[0] for s in SHAPES])
def test_decode_compiles_once_for_any_context(monkeypatch, name, heads, kv_heads, lk, lv):
    monkeypatch.setattr(tk, "launch_config", partial(tk.launch_config, device="cuda", num_sms=132))
    spy = Spy(monkeypatch)
    backend = TritonBackend()
    rng = random.Random(26)
    g = torch.Generator().manual_seed(26)
    scale = lk**-0.5

    def call(
        lens: list[int], table: torch.Tensor, table_rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ):
        """One decode step through the backend, as the model runner builds its metadata."""
        batch = len(lens)
        meta = AttentionMetadata(
            req_to_token=table,
            table_rows=table_rows,
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=DEV),
            q_start=torch.arange(batch + 1, dtype=torch.int32, device=DEV),
            num_tokens=batch,
            max_q_len=1,
            max_seq_len=max(lens),
            q_lens_host=[1] * batch,
            seq_lens_host=lens,
        )
        q = torch.randn(batch, heads, lk, generator=g).to(DEV)
        if name == "mla":
            return q, backend.mla(q, k[:, 0], meta, scale, lv)
        return q, backend.gqa(q, k, v, meta, scale)

    # Recorded only: the lengths' values never reach the kernels, so a zero table serves them all.
    table = torch.zeros(MAX_BATCH + 1, MAX_LEN, dtype=torch.int32, device=DEV)
    rows = torch.arange(1, MAX_BATCH + 1, dtype=torch.int32, device=DEV)
    k_cache = torch.randn(16, kv_heads, lk, generator=g).to(DEV)
    v_cache = k_cache[..., :lv] if name == "mla" else torch.randn(16, kv_heads, lv, generator=g).to(DEV)
    for _ in range(1000):
        batch = rng.randint(1, MAX_BATCH)
        call([rng.randint(1, MAX_LEN) for _ in range(batch)], table, rows[:batch], k_cache, v_cache)

    # Executed: a few steps of 1 to 3 requests on shuffled slots (short rows leave splits empty).
    spy.execute = True
    for lens in ([2000, 1, 5], [700], [300, 64], [1], [1200, 900]):
        slots = torch.randperm(sum(lens), generator=g).to(torch.int32)
        table = torch.zeros(len(lens) + 1, MAX_LEN, dtype=torch.int32)  # the runner's fixed width
        for b, pos in enumerate(torch.tensor(lens).cumsum(0).tolist()):
            table[b + 1, : lens[b]] = slots[pos - lens[b] : pos]
        table = table.to(DEV)
        k_cache = torch.randn(sum(lens), kv_heads, lk, generator=g).to(DEV)
        v_cache = (
            k_cache[..., :lv] if name == "mla" else torch.randn(sum(lens), kv_heads, lv, generator=g).to(DEV)
        )
        table_rows = torch.arange(1, len(lens) + 1, dtype=torch.int32, device=DEV)
        q, out = call(lens, table, table_rows, k_cache, v_cache)
        expected = _reference(q, k_cache, v_cache, table, table_rows, lens, scale)
        torch.testing.assert_close(out.float(), expected, atol=1e-4, rtol=1e-4)

    assert len(spy.splits) >= 8, spy.splits  # the calls really spanned many split counts
    for kernel, keys in spy.keys.items():
        assert len(keys) == 1, f"{kernel}: {len(keys)} compiled variants for one head shape"
