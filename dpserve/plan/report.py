"""The planner's outputs: a table (rich, plain or markdown), recommendations, --json, --plot.

JSON schema `dpserve.plan/1` (stable, grows only by new fields; docs/tuning.md's tables use these fields):

    schema, model, model_path, arch, num_gpus, nnodes
    profile: name, device, source, memory_bytes, mem_bw, flops, intra_bw, intra_alpha, inter_bw, inter_alpha,
        provenance: {measured_at (ISO, UTC), load, cores, torch, cpu_model} of a measured (cpu) profile, else {}
    workload: input_len, output_len, concurrency, request_rate, tpot_ms
    layouts[]: name, flags, tp, dp, dp_attention, attn_tp, moe (tp, ep or ep-a2a: the MoE placement),
        valid, fits, reason (null when it runs),
        weight_bytes_per_rank, kv_bytes_per_token, activation_bytes, kv_budget_bytes,
        kv_tokens_per_group, groups, kv_tokens_total, max_concurrency,
        window_bytes_per_token, window_tokens_per_group, kv_tokens_per_group_without_hybrid (the hybrid
            sliding-window pool: kv_bytes_per_token then counts the full layers only; 0 without one),
        prefill_chunk_tokens, prefill_chunk_ms, prefill_chunk_comm_bytes (one rank sends, in that step),
        decode[]: batch, step_ms, tokens_per_s, padding_mode, mlp_rows, comm_bytes (one rank sends),
                  parts_ms{attention, mlp, lm_head, collectives, fixed}
        at_concurrency: a decode entry (the table's @conc columns) or null
        best_under_tpot: a decode entry (the table's @TPOT columns): the largest batch, up to
            max_concurrency, whose step is within tpot_ms; null without a target or when batch 1 misses it
    recommendations: lowest_latency, highest_throughput, most_kv: {name, flags, why} or null;
        lowest_latency and highest_throughput also carry step: the decode entry `why` quotes
"""

from __future__ import annotations

import json

from dpserve.plan.planner import LayoutPlan, Plan, StepTime

SCHEMA = "dpserve.plan/1"
GiB = 2**30


def _step(s: StepTime | None) -> dict | None:
    if s is None:
        return None
    return {
        "batch": s.batch,
        "step_ms": round(s.seconds * 1e3, 4),
        "tokens_per_s": round(s.throughput, 2),
        "padding_mode": s.mode,
        "mlp_rows": s.mlp_rows,
        "comm_bytes": s.comm_bytes,
        "parts_ms": {k: round(v * 1e3, 4) for k, v in s.parts.items()},
    }


def runs(lp: LayoutPlan) -> bool:
    return lp.mem.valid and lp.max_concurrency > 0


def reason(lp: LayoutPlan) -> str:
    """Why a layout does not run (the engine's reason, or the planner's)."""
    return lp.mem.error or "no request of this workload fits the KV pool"


# One format per figure, shared by the table and the recommendations so that they quote alike.
def _ms(s: StepTime) -> str:
    return f"{s.seconds * 1e3:.2f}"


def _tps(s: StepTime) -> str:
    return f"{s.throughput:.0f}"


def recommendations(plan: Plan) -> dict:
    ok = [lp for lp in plan.layouts if runs(lp)]

    def entry(lp: LayoutPlan | None, why: str, step: StepTime | None = None) -> dict | None:
        if lp is None:
            return None
        out = {"name": lp.layout.name, "flags": lp.layout.flags, "why": why}
        return out | ({"step": _step(step)} if step else {})

    if not ok:
        return {"lowest_latency": None, "highest_throughput": None, "most_kv": None}
    lat = min(ok, key=lambda lp: lp.decode[0].seconds)
    first = lat.decode[0]
    rec = {"lowest_latency": entry(lat, f"{_ms(first)} ms per decode step at batch {first.batch}", first)}
    tpot = plan.workload.tpot_ms
    if tpot:
        best = max(
            (lp for lp in ok if lp.best_under_tpot),
            key=lambda lp: lp.best_under_tpot.throughput,
            default=None,
        )
        step = best.best_under_tpot if best else None
    else:
        best = max(ok, key=lambda lp: lp.at_concurrency.throughput)
        step = best.at_concurrency
    within = f" within TPOT {tpot:g} ms" if tpot else ""
    why = f"{_tps(step)} tok/s at concurrency {step.batch} ({_ms(step)} ms per step){within}" if step else ""
    rec["highest_throughput"] = entry(best, why, step)
    kv = max(ok, key=lambda lp: (lp.mem.kv_tokens_total, -lp.decode[0].seconds))
    rec["most_kv"] = entry(kv, f"{kv.mem.kv_tokens_total} KV tokens over all GPUs")
    return rec


def to_json(plan: Plan) -> dict:
    p = plan.profile
    out = {
        "schema": SCHEMA,
        "model": plan.model,
        "model_path": plan.model_path,
        "arch": plan.model_cfg.arch,
        "quantization": plan.model_cfg.quant.method if plan.model_cfg.quant else None,
        "notes": notes(plan),
        "num_gpus": plan.num_gpus,
        "nnodes": plan.nnodes,
        "profile": {
            k: getattr(p, k)
            for k in (
                "name",
                "device",
                "source",
                "memory_bytes",
                "mem_bw",
                "flops",
                "intra_bw",
                "intra_alpha",
            )
        }
        | {"inter_bw": p.inter_bw, "inter_alpha": p.inter_alpha, "provenance": p.provenance},
        "workload": {
            k: getattr(plan.workload, k)
            for k in ("input_len", "output_len", "concurrency", "request_rate", "tpot_ms")
        },
        "layouts": [],
        "recommendations": recommendations(plan),
    }
    for lp in plan.layouts:
        m, lay = lp.mem, lp.layout
        out["layouts"].append(
            {
                "name": lay.name,
                "flags": lay.flags,
                "tp": lay.tp,
                "dp": lay.dp,
                "dp_attention": lay.dp_attention,
                "attn_tp": lay.tp // lay.dp if lay.dp_attention else lay.tp,
                "moe": lay.moe,
                "valid": m.cfg is not None,
                "fits": m.valid,
                "reason": m.error,
                "weight_bytes_per_rank": m.weight_bytes,
                "kv_bytes_per_token": m.kv_bytes_per_token,
                "activation_bytes": m.activation_bytes,
                "kv_budget_bytes": m.kv_budget_bytes,
                "kv_tokens_per_group": m.kv_tokens_per_group,
                "window_bytes_per_token": m.window_bytes_per_token,
                "window_tokens_per_group": m.window_tokens_per_group,
                "kv_tokens_per_group_without_hybrid": m.tokens_without_hybrid,
                "groups": m.groups,
                "kv_tokens_total": m.kv_tokens_total,
                "max_concurrency": lp.max_concurrency,
                "prefill_chunk_tokens": lp.prefill_chunk_tokens,
                "prefill_chunk_ms": round(lp.prefill_chunk_s * 1e3, 4),
                "prefill_chunk_comm_bytes": lp.prefill_chunk_comm_bytes,
                "decode": [_step(s) for s in lp.decode],
                "at_concurrency": _step(lp.at_concurrency),
                "best_under_tpot": _step(lp.best_under_tpot),
            }
        )
    return out


def _shows_concurrency(plan: Plan) -> bool:
    """The @conc columns: without a TPOT target, or when the workload names a load to plan at."""
    wl = plan.workload
    return not wl.tpot_ms or bool(wl.concurrency or wl.request_rate)


def headers(plan: Plan) -> list[str]:
    cols = ["layout", "weights/rank GiB", "KV B/token/rank", "KV tokens/group", "KV tokens total"]
    cols += ["max conc", "step ms @1"]
    if _shows_concurrency(plan):
        cols += ["step ms @conc", "tok/s @conc", "mode @conc"]
    if plan.workload.tpot_ms:  # the largest concurrency within the target, and what it gives
        cols += ["conc @TPOT", "step ms @TPOT", "tok/s @TPOT", "mode @TPOT"]
    return [*cols, "prefill chunk ms"]


def _ranges(values: list[int]) -> str:
    """[3, 5, 6, 7, 9, 10] -> '3, 5-7, 9, 10'."""
    spans: list[list[int]] = []
    for v in sorted(values):
        if spans and v == spans[-1][1] + 1:
            spans[-1][1] = v
        else:
            spans.append([v, v])
    return ", ".join(str(a) if a == b else f"{a}-{b}" if b > a + 1 else f"{a}, {b}" for a, b in spans)


def rows(plan: Plan) -> tuple[list[list[str]], list[tuple[str, str]]]:
    """The table's rows, and (what, why) of the layouts that cannot run: one entry each, except
    DP attention layouts whose dp does not divide tp, summarised in one entry per tp."""
    table, invalid = [], []
    indivisible: dict[int, set[int]] = {}  # every MoE placement of a dp alike: one entry
    for lp in plan.layouts:
        m, lay = lp.mem, lp.layout
        if m.cfg is None and lay.dp_attention and lay.tp % lay.dp:
            indivisible.setdefault(lay.tp, set()).add(lay.dp)
            continue
        if not runs(lp):
            invalid.append((lay.name, reason(lp)))
            continue
        row = [
            lay.name,
            f"{m.weight_bytes / GiB:.2f}",
            f"{m.kv_bytes_per_token}",
            f"{m.kv_tokens_per_group}",
            f"{m.kv_tokens_total}",
            f"{lp.max_concurrency}",
            _ms(lp.decode[0]),
        ]
        if _shows_concurrency(plan):
            c = lp.at_concurrency
            row += [f"{_ms(c)} (b={c.batch})", _tps(c), c.mode]
        if plan.workload.tpot_ms:
            t = lp.best_under_tpot  # None: batch 1 already misses the target
            row += [str(t.batch), _ms(t), _tps(t), t.mode] if t else ["-"] * 4
        table.append([*row, f"{lp.prefill_chunk_s * 1e3:.1f}"])
    for tp, dps in indivisible.items():
        invalid.append(
            (f"dp {_ranges(list(dps))}", f"tp {tp} must be divisible by dp (attention TP = tp / dp)")
        )
    return table, invalid


def weights_format(plan: Plan) -> str:
    """', weights fp8 (blocks of [128, 128])' for a quantized model, else ''."""
    quant = plan.model_cfg.quant
    return f", weights {quant.method} ({quant.describe()})" if quant else ""


def header_line(plan: Plan) -> str:
    wl = plan.workload
    return (
        f"{plan.model} ({plan.model_cfg.arch}{weights_format(plan)}) on {plan.num_gpus} x {plan.profile.name} "
        f"({plan.nnodes} node(s)); "
        f"input {wl.input_len}, output {wl.output_len} tokens"
        + (f", concurrency {wl.concurrency}" if wl.concurrency else "")
        + (f", {wl.request_rate:g} req/s" if wl.request_rate else "")
        + (f", TPOT target {wl.tpot_ms:g} ms" if wl.tpot_ms else "")
    )


def notes(plan: Plan) -> list[str]:
    """Sentences under the table: what the hybrid pool gives."""
    return [n for n in (window_note(plan),) if n]


def window_note(plan: Plan) -> str | None:
    """What the hybrid sliding-window pool gives, on the first layout that fits."""
    m = next((lp.mem for lp in plan.layouts if lp.mem.valid and lp.mem.window_tokens_per_group), None)
    if m is None:
        return None
    return (
        f"sliding-window layers keep their own pool ({m.cfg.swa_full_tokens_ratio:g} x the full one: "
        f"--swa-full-tokens-ratio): {m.layout.name} holds {m.kv_tokens_per_group} tokens per group, "
        f"{m.kv_tokens_per_group / m.tokens_without_hybrid:.2f}x the {m.tokens_without_hybrid} of every "
        "layer keeping every token (--disable-hybrid-swa-memory)"
    )


def render_markdown(plan: Plan) -> str:
    table, invalid = rows(plan)
    cols = headers(plan)
    lines = [header_line(plan), "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(r) + " |" for r in table]
    for note in notes(plan):
        lines += ["", note[0].upper() + note[1:] + "."]
    if invalid:
        lines += ["", "Not possible:", ""] + [f"- `{n}`: {why}" for n, why in invalid]
    lines += ["", "Recommendations:", ""]
    for k, v in recommendations(plan).items():
        lines.append(f"- {k}: " + (f"`{v['flags']}` ({v['name']}): {v['why']}" if v else "none"))
    return "\n".join(lines)


def render_text(plan: Plan, use_rich: bool = True) -> str:
    if not use_rich:
        return render_markdown(plan)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        return render_markdown(plan)
    table, invalid = rows(plan)
    t = Table(title=header_line(plan))
    for h in headers(plan):
        t.add_column(h, justify="left" if h == "layout" else "right")
    for r in table:
        t.add_row(*r)
    console = Console(width=200, record=True)
    with console.capture() as cap:
        console.print(t)
        for note in notes(plan):
            console.print(note, highlight=False)
        for n, why in invalid:
            console.print(f"[dim]not possible: {n}: {why}[/dim]", highlight=False)
        for k, v in recommendations(plan).items():
            text = f"{v['flags']} ({v['name']}): {v['why']}" if v else "none"
            console.print(f"[bold]{k}[/bold]: {text}", highlight=False)
    return cap.get()


def plot(plan: Plan, path: str) -> None:
    """Latency (ms per output token) against output throughput, one line per layout."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for lp in plan.layouts:
        if not runs(lp) or not lp.decode:
            continue
        xs = [s.throughput for s in lp.decode]
        ys = [s.seconds * 1e3 for s in lp.decode]
        ax.plot(xs, ys, marker="o", label=lp.layout.name)
    ax.set_xscale("log")
    ax.set_xlabel("output tokens/s (all GPUs)")
    ax.set_ylabel("decode step = TPOT (ms)")
    ax.set_title(header_line(plan), fontsize=8)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def dumps(plan: Plan) -> str:
    return json.dumps(to_json(plan), indent=1)
