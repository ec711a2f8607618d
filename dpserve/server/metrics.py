"""Prometheus text exposition of the front end's counters and each DP rank's load."""

from __future__ import annotations

# name, type, help, key in a DP rank's figures
PER_DP_RANK = [
    ("num_running_reqs", "gauge", "Requests in the running batch", "running"),
    ("num_queue_reqs", "gauge", "Requests waiting for admission", "queued"),
    ("kv_used_tokens", "gauge", "KV pool slots holding tokens", "kv_used"),
    ("kv_free_tokens", "gauge", "KV pool slots free", "kv_free"),
    (
        "kv_reserved_tokens",
        "gauge",
        "KV slots reserved for admitted requests (prompt + max new)",
        "kv_reserved",
    ),
    ("max_total_num_tokens", "gauge", "KV pool size in tokens", "max_total_num_tokens"),
    (
        "outstanding_tokens",
        "gauge",
        "Router's count: prompt tokens to prefill + decode budgets left",
        "outstanding_tokens",
    ),
    ("inflight_requests", "gauge", "Router's count of requests in flight", "inflight_requests"),
    ("generation_tokens_total", "counter", "Tokens generated", "generated_tokens"),
    ("prefill_tokens_total", "counter", "Prompt tokens prefilled", "prefilled_tokens"),
    ("steps_eager_total", "counter", "Forward steps run eagerly (no captured graph)", "steps_eager"),
    (
        "steps_graph_total",
        "counter",
        "Forward steps run as captured graphs (padded buckets on CPU)",
        "steps_graph",
    ),
]

FRONT_END = [
    ("requests_total", "counter", "Sequences submitted", "requests"),
    ("prompt_tokens_total", "counter", "Prompt tokens submitted", "prompt_tokens"),
    (
        "aborted_requests_total",
        "counter",
        "Sequences aborted (client gone, stop string, shutdown)",
        "aborted",
    ),
]


def render_metrics(m: dict) -> str:
    lines = []
    for name, kind, text, key in FRONT_END:
        lines += [f"# HELP dpserve_{name} {text}", f"# TYPE dpserve_{name} {kind}"]
        lines.append(f"dpserve_{name} {m['counters'][key]}")
    for name, kind, text, key in PER_DP_RANK:
        lines += [f"# HELP dpserve_{name} {text}", f"# TYPE dpserve_{name} {kind}"]
        lines += [f'dpserve_{name}{{dp_rank="{r["dp_rank"]}"}} {r[key]}' for r in m["dp_ranks"]]
    return "\n".join(lines) + "\n"
