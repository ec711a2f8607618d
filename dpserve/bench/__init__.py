"""Benchmark tools: one_batch (static batch latency), padding (DP padding-mode sweep), serving (online,
with a transformers baseline), kv (prefix cache and routing, head-of-line blocking, an oversubscribed pool)."""
