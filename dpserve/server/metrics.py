"""Prometheus metrics through prometheus_client: the front end's counters, each DP rank's load
and cache figures (read from the latest worker reports at scrape time), and latency histograms."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# name (counters get "_total" appended), kind, help, key in a DP rank's figures
PER_DP_RANK = [
    ("num_running_reqs", "gauge", "Requests in the running batch", "running"),
    ("num_queue_reqs", "gauge", "Requests waiting for admission (retracted ones included)", "queued"),
    (
        "kv_used_tokens",
        "gauge",
        "KV slots held by running requests (their cached prefixes included)",
        "kv_used",
    ),
    ("kv_free_tokens", "gauge", "KV slots free", "kv_free"),
    (
        "kv_reserved_tokens",
        "gauge",
        "KV slots the admission estimate expects running requests to take (rest of prefill + "
        "new_token_ratio of their decode budget)",
        "kv_reserved",
    ),
    ("kv_cached_tokens", "gauge", "KV slots held by the radix prefix cache", "kv_cached"),
    ("kv_evictable_tokens", "gauge", "Prefix-cache slots no running request uses", "kv_evictable"),
    ("max_total_num_tokens", "gauge", "KV pool size in tokens", "max_total_num_tokens"),
    (
        "kv_window_pool_tokens",
        "gauge",
        "Sliding-window layers' own KV pool size in tokens (0: every layer keeps every token)",
        "window_tokens",
    ),
    ("kv_window_free_tokens", "gauge", "Sliding-window layers' KV slots free", "kv_window_free"),
    (
        "kv_window_cached_tokens",
        "gauge",
        "Sliding-window layers' KV slots the prefix cache holds (evicted first when short)",
        "kv_window_cached",
    ),
    (
        "kv_window_evicted_tokens",
        "counter",
        "Sliding-window layers' KV the prefix cache gave up for new tokens",
        "window_evicted_tokens",
    ),
    ("new_token_ratio", "gauge", "Share of decode budgets counted at admission", "new_token_ratio"),
    (
        "outstanding_tokens",
        "gauge",
        "Router's count: prompt tokens to prefill + decode budgets left",
        "outstanding_tokens",
    ),
    ("inflight_requests", "gauge", "Router's count of requests in flight", "inflight_requests"),
    ("generation_tokens", "counter", "Tokens generated", "generated_tokens"),
    ("prefill_tokens", "counter", "Prompt tokens prefilled (cache hits excluded)", "prefilled_tokens"),
    ("prefix_cache_hit_tokens", "counter", "Prompt tokens found in the prefix cache", "cache_hit_tokens"),
    (
        "prefix_cache_evicted_tokens",
        "counter",
        "Prefix-cache tokens evicted to make room",
        "cache_evicted_tokens",
    ),
    ("retractions", "counter", "Running requests retracted under memory pressure", "retractions"),
    ("spec_verify_steps", "counter", "Request decode steps with speculative decoding", "spec_verify_steps"),
    ("spec_draft_tokens", "counter", "Speculative draft tokens proposed", "spec_draft_tokens"),
    ("spec_accepted_tokens", "counter", "Speculative draft tokens accepted", "spec_accepted_tokens"),
    (
        "spec_accept_length",
        "gauge",
        "Mean tokens per speculative verify step (accepted drafts + 1)",
        "spec_accept_length",
    ),
    ("grammar_compiles", "counter", "Grammars compiled (structured output)", "grammar_compiles"),
    ("grammar_cache_hits", "counter", "Requests whose grammar was already compiled", "grammar_cache_hits"),
    (
        "grammar_compile_seconds",
        "counter",
        "Seconds spent compiling grammars, off the step loop",
        "grammar_compile_seconds",
    ),
    ("steps_eager", "counter", "Forward steps run unpadded and eagerly", "steps_eager"),
    (
        "steps_padded",
        "counter",
        "Forward steps padded to a decode bucket (CUDA graph replays on GPU, padded eager steps on CPU)",
        "steps_padded",
    ),
]

FRONT_END = [
    ("requests", "counter", "Sequences submitted", "requests"),
    ("prompt_tokens", "counter", "Prompt tokens submitted", "prompt_tokens"),
    ("aborted_requests", "counter", "Sequences aborted (client gone, stop string, shutdown)", "aborted"),
]

# The HTTP layer's admission (server/admission.py): what it holds and what it refused.
ADMISSION = [
    (
        "requests_in_flight",
        "gauge",
        "Generation requests admitted and not answered yet (waiting or running)",
        "requests_in_flight",
    ),
    (
        "requests_waiting",
        "gauge",
        "Generation requests admitted and not running yet; --max-queued-requests bounds it",
        "requests_waiting",
    ),
]

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, float("inf"))


class _Snapshot(Collector):
    """Turns the front end's figures into metric families at each scrape."""

    def __init__(self, figures: Callable[[], dict]):
        self.figures = figures

    def collect(self) -> Iterator[Metric]:
        m = self.figures()
        for name, kind, text, key in FRONT_END:
            family = _family(kind, name, text, [])
            family.add_metric([], m["counters"][key])
            yield family
        for name, kind, text, key in PER_DP_RANK:
            family = _family(kind, name, text, ["dp_rank"])
            for r in m["dp_ranks"]:
                family.add_metric([str(r["dp_rank"])], r[key])
            yield family


class _AdmissionSnapshot(Collector):
    def __init__(self, figures: Callable[[], dict]):
        self.figures = figures

    def collect(self) -> Iterator[Metric]:
        m = self.figures()
        for name, kind, text, key in ADMISSION:
            family = _family(kind, name, text, [])
            family.add_metric([], m[key])
            yield family
        family = _family(
            "counter",
            "rejected_requests",
            "Requests refused before any work: overloaded and draining (503), unauthorized (401), "
            "too_large (413)",
            ["reason"],
        )
        for reason, count in m["rejected_requests"].items():
            family.add_metric([reason], count)
        yield family


def _family(kind: str, name: str, text: str, labels: list[str]) -> Metric:
    cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
    return cls(f"dpserve_{name}", text, labels=labels)


class ServerMetrics:
    """The registry /metrics exposes; the front end observes request latencies into it."""

    def __init__(self, figures: Callable[[], dict]):
        self.registry = CollectorRegistry()
        self.registry.register(_Snapshot(figures))
        self.time_to_first_token = Histogram(
            "dpserve_time_to_first_token_seconds",
            "Seconds from a request's arrival to its first token",
            registry=self.registry,
            buckets=LATENCY_BUCKETS,
        )
        self.time_per_output_token = Histogram(
            "dpserve_time_per_output_token_seconds",
            "Seconds per output token after the first, per finished request",
            registry=self.registry,
            buckets=LATENCY_BUCKETS,
        )

        self.expert_imbalance = Histogram(
            "dpserve_expert_imbalance",
            "Per MoE step: rows of the busiest expert-parallel rank over the mean rank's (1: balanced)",
            ["dp_rank"],
            registry=self.registry,
            buckets=(1.0, 1.1, 1.25, 1.5, 2, 3, 4, 8, float("inf")),
        )

        # --enable-eplb: each rebalance, as every group leader reports it.
        self.eplb_rebalances = Counter(
            "dpserve_eplb_rebalances", "Expert rebalances done", ["dp_rank"], registry=self.registry
        )
        self.eplb_bytes_moved = Counter(
            "dpserve_eplb_bytes_moved",
            "Expert weight bytes rebalancing sent between ranks, all ranks",
            ["dp_rank"],
            registry=self.registry,
        )
        self.eplb_seconds = Counter(
            "dpserve_eplb_rebalance_seconds",
            "Seconds the group leader spent moving experts between steps",
            ["dp_rank"],
            registry=self.registry,
        )
        self.eplb_imbalance = Gauge(
            "dpserve_eplb_imbalance",
            "The last rebalance window's rows per rank over the mean rank's (mean over MoE layers) on "
            "the placement before and after it",
            ["dp_rank", "placement"],
            registry=self.registry,
        )
        self.eplb_last = Gauge(
            "dpserve_eplb_last_rebalance_timestamp_seconds",
            "When the last rebalance ended (Unix time)",
            ["dp_rank"],
            registry=self.registry,
        )

    def observe_rebalance(self, dp_rank: int, rebalance) -> None:
        """Records one rebalance (a messages.Rebalance) a group leader reported."""
        g = str(dp_rank)
        self.eplb_rebalances.labels(g).inc()
        self.eplb_bytes_moved.labels(g).inc(rebalance.bytes_moved)
        self.eplb_seconds.labels(g).inc(rebalance.seconds)
        self.eplb_imbalance.labels(g, "before").set(rebalance.imbalance_before)
        self.eplb_imbalance.labels(g, "after").set(rebalance.imbalance_after)
        self.eplb_last.labels(g).set_to_current_time()

    def watch_admission(self, figures: Callable[[], dict]) -> None:
        """Exposes the HTTP admission's figures (requests in flight, refusals by reason)."""
        self.registry.register(_AdmissionSnapshot(figures))

    def render(self) -> bytes:
        return generate_latest(self.registry)
