"""The planner's PD mode (`python -m dpserve.plan --pd PREFILL DECODE`): a prefill instance and a
decode instance of the model, each with its own layout on its own GPUs, as prefill-decode
disaggregation runs them (docs/design.md, section 14): what each side holds, how many requests per
second each keeps up with, and the KV one request moves from prefill to decode, with the bandwidth
that takes at the workload's request rate.

The KV a request moves is what the decode side keeps of its prompt: every rank of the receiving DP
group holds its own rows (MLA: the whole latent on each; GQA: its heads), so the group receives
`attention TP x prompt tokens x bytes per token per rank`; a hybrid pool's window layers only the
prompt's last W - 1 positions (what the first decode step's window queries read). Each decode rank receives its own rows over its own link.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dpserve.plan.planner import LayoutPlan, Plan


@dataclass
class PDPlan:
    prefill: Plan  # one layout: the prefill instance's
    decode: Plan  # one layout: the decode instance's
    bytes_per_request: int  # KV written from prefill to decode per request, all receiving ranks
    prefill_s: float  # one request's prefill on one prefill group (its chunks one after another)
    prefill_rps: float  # requests per second the prefill instance prefills, every group busy
    decode_rps: float  # requests per second the decode instance finishes at its concurrency
    rank_bytes_per_s: float  # one decode rank receives at the workload's request rate (0: no rate)
    link_share: float  # of one device's cross-node bandwidth (the profile's)

    @property
    def prefill_side(self) -> LayoutPlan:
        return self.prefill.layouts[0]

    @property
    def decode_side(self) -> LayoutPlan:
        return self.decode.layouts[0]


def pd_plan(prefill: Plan, decode: Plan) -> PDPlan:
    """The PD figures of two one-layout plans of the same model and workload."""
    p, d, wl = prefill.layouts[0], decode.layouts[0], decode.workload
    for side, lp in (("prefill", p), ("decode", d)):
        if not lp.mem.valid:
            raise ValueError(f"the {side} layout {lp.layout.name} cannot run: {lp.mem.error}")
    mem = d.mem
    window = decode.model_cfg.hf.sliding_window if mem.window_tokens_per_group else 0
    # The window layers' rows of the prompt's last W - 1 positions: what the first decode step reads.
    per_rank = (
        wl.input_len * mem.kv_bytes_per_token
        + min(wl.input_len, max(0, window - 1)) * mem.window_bytes_per_token
    )
    attn_tp = mem.cfg.attn_tp_size
    chunks = math.ceil(wl.input_len / p.prefill_chunk_tokens)
    prefill_s = chunks * p.prefill_chunk_s
    step = d.at_concurrency
    decode_rps = step.batch / (wl.output_len * step.seconds) if step else 0.0
    rank_rate = (wl.request_rate or 0.0) / mem.groups * per_rank
    return PDPlan(
        prefill,
        decode,
        per_rank * attn_tp,
        prefill_s,
        p.mem.groups / prefill_s,
        decode_rps,
        rank_rate,
        rank_rate / decode.profile.inter_bw,
    )


def to_json(pd: PDPlan) -> dict:
    p, d = pd.prefill_side, pd.decode_side
    return {
        "prefill": {
            "layout": p.layout.name,
            "flags": p.layout.flags,
            "kv_tokens_per_group": p.mem.kv_tokens_per_group,
            "kv_tokens_total": p.mem.kv_tokens_total,
            "prefill_ms_per_request": pd.prefill_s * 1e3,
            "requests_per_s": pd.prefill_rps,
        },
        "decode": {
            "layout": d.layout.name,
            "flags": d.layout.flags,
            "kv_tokens_per_group": d.mem.kv_tokens_per_group,
            "kv_tokens_total": d.mem.kv_tokens_total,
            "max_concurrency": d.max_concurrency,
            "step_ms": d.at_concurrency.seconds * 1e3 if d.at_concurrency else None,
            "requests_per_s": pd.decode_rps,
        },
        "transfer": {
            "bytes_per_request": pd.bytes_per_request,
            "rank_bytes_per_s": pd.rank_bytes_per_s,
            "link_share": pd.link_share,
        },
    }


def render(pd: PDPlan) -> str:
    p, d, wl = pd.prefill_side, pd.decode_side, pd.decode.workload
    lines = [
        f"{pd.decode.model} on {pd.prefill.profile.name}: prefill {p.layout.flags} "
        f"({p.layout.num_gpus} GPUs), decode {d.layout.flags} ({d.layout.num_gpus} GPUs); "
        f"input {wl.input_len}, output {wl.output_len} tokens",
        f"prefill: {p.mem.kv_tokens_total} KV tokens in all, {pd.prefill_s * 1e3:.1f} ms per request "
        f"on one group, {pd.prefill_rps:.1f} requests/s with every group busy",
        f"decode: {d.mem.kv_tokens_total} KV tokens in all, {d.max_concurrency} requests fit, "
        + (
            f"{d.at_concurrency.seconds * 1e3:.2f} ms per step at {d.at_concurrency.batch}: "
            f"{pd.decode_rps:.1f} requests/s"
            if d.at_concurrency
            else "no request of this workload fits"
        ),
        f"transfer: {pd.bytes_per_request / 2**20:.2f} MiB of KV per request"
        + (
            f"; at {wl.request_rate:g} requests/s each decode rank receives "
            f"{pd.rank_bytes_per_s / 1e9:.2f} GB/s, {pd.link_share:.0%} of its link"
            if wl.request_rate
            else " (give --request-rate for the bandwidth it takes)"
        ),
    ]
    return "\n".join(lines)
