"""The offline Engine: starts one process per rank and talks to the group leaders over ZMQ."""

from __future__ import annotations

import contextlib
import itertools
import logging
import uuid

from dpserve.config import EngineConfig
from dpserve.engine.workers import WorkerFailure, WorkerSet
from dpserve.models.config import ModelConfig
from dpserve.sampling_params import SamplingParams
from dpserve.scheduler.request import GenerateRequest, check_request

__all__ = ["Engine", "WorkerFailure"]

logger = logging.getLogger("dpserve")


def load_model(cfg: EngineConfig) -> ModelConfig:
    """Reads and checks the model config against the layout, before any process starts."""
    model_cfg = ModelConfig.load(cfg.model_path)
    model_cfg.validate(cfg.rank_topology(0)[1])
    if cfg.speculative_algorithm == "NEXTN":
        model_cfg.check_mtp()
    return model_cfg


def log_ready(cfg: EngineConfig, model_cfg: ModelConfig, dp_info: list[dict]) -> None:
    per_group = dp_info[0]["max_total_num_tokens"]
    logger.info(
        "ready: %s tp=%d dp=%d (%s) attention TP=%d, %d ranks per node on %d node(s); KV %d tokens per "
        "DP group (%d bytes/token), %d for the instance; prefill budget %d tokens per group, %d global",
        model_cfg.arch,
        cfg.tp_size,
        cfg.dp_size,
        "DP attention" if cfg.enable_dp_attention else f"{cfg.num_instances} replica(s)",
        cfg.attn_tp_size,
        cfg.ranks_per_node,
        cfg.nnodes,
        per_group,
        dp_info[0]["kv_bytes_per_token"],
        per_group * cfg.dp_size,
        cfg.chunked_prefill_size,
        cfg.chunked_prefill_size * cfg.dp_size,
    )


def server_info(cfg: EngineConfig, dp_info: list[dict]) -> dict:
    return {
        "tp_size": cfg.tp_size,
        "dp_size": cfg.dp_size,
        "attn_tp_size": cfg.attn_tp_size,
        "enable_dp_attention": cfg.enable_dp_attention,
        "nnodes": cfg.nnodes,
        "dtype": cfg.dtype,
        "attention_backend": cfg.attention_backend,
        "dp_padding_mode": cfg.dp_padding_mode,
        "graph_buckets": cfg.graph_buckets,
        "chunked_prefill_size": cfg.chunked_prefill_size,
        "max_running_requests": cfg.max_running_requests,
        "mem_fraction_static": cfg.mem_fraction_static,
        "radix_cache": not cfg.disable_radix_cache,
        "dp_ranks": [
            {
                "dp_rank": g,
                "max_total_num_tokens": info["max_total_num_tokens"],
                "kv_bytes_per_token": info["kv_bytes_per_token"],
                "weight_bytes": info["weight_bytes"],  # parameters and buffers of the group leader
                "activation_bytes": info["activation_bytes"],  # measured peak (GPU; 0 on the CPU)
            }
            for g, info in enumerate(dp_info)
        ],
    }


class Engine:
    """DP-attention inference engine (design section 6).

    Engine(model_path=..., tp_size=4, dp_size=2, enable_dp_attention=True, device="cpu",
           dtype="float32", random_seed=0, max_total_tokens=..., ...)
    """

    def __init__(self, model_path: str | None = None, **kwargs):
        self.cfg = EngineConfig(model_path=model_path, **kwargs)
        if self.cfg.nnodes > 1:
            raise ValueError("the offline Engine runs on one node; use launch_server for nnodes > 1")
        self.model_cfg = load_model(self.cfg)
        self.tokenizer = _load_tokenizer(self.cfg.model_path)
        self._next_group = itertools.count()
        self._results: dict[str, dict] = {}
        self._step_logs: dict[int, list] = {}
        self.workers = WorkerSet(self.cfg)
        self.dp_info = self.workers.dp_info
        self._stats = {g: info["stats"] for g, info in enumerate(self.dp_info)}
        log_ready(self.cfg, self.model_cfg, self.dp_info)

    # --- public API -------------------------------------------------------------------------

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
    ) -> dict | list[dict]:
        """Generates for one prompt (returns a dict) or a batch (returns a list of dicts)."""
        if (prompt is None) == (input_ids is None):
            raise ValueError("pass exactly one of prompt or input_ids")
        single = isinstance(prompt, str) or (
            input_ids is not None and input_ids and isinstance(input_ids[0], int)
        )
        if prompt is not None:
            if self.tokenizer is None:
                raise ValueError(f"no tokenizer in {self.cfg.model_path}; pass input_ids instead")
            prompts = [prompt] if single else list(prompt)
            ids = [self.tokenizer.encode(p) for p in prompts]
        else:
            ids = [list(input_ids)] if single else [list(x) for x in input_ids]
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(ids):
                raise ValueError(f"{len(sampling_params)} sampling_params for {len(ids)} prompts")
            params = [SamplingParams.from_dict(p) for p in sampling_params]
        else:
            params = [SamplingParams.from_dict(sampling_params)] * len(ids)
        groups = [next(self._next_group) % self.cfg.dp_size for _ in ids]
        for i, (x, p, g) in enumerate(zip(ids, params, groups, strict=True)):
            try:
                self._check_fits(x, p, g)
            except ValueError as e:
                raise ValueError(f"request {i}: {e}") from None
        rids = [self._submit(x, p, return_logprob, g) for x, p, g in zip(ids, params, groups, strict=True)]
        results = [self.wait(rid) for rid in rids]
        return results[0] if single else results

    def submit(
        self,
        input_ids: list[int],
        sampling_params: dict | None = None,
        return_logprob: bool = False,
        dp_rank: int | None = None,
    ) -> str:
        """Queues one request without waiting; returns its id for `wait`."""
        params = SamplingParams.from_dict(sampling_params)
        group = next(self._next_group) % self.cfg.dp_size if dp_rank is None else dp_rank
        if not 0 <= group < self.cfg.dp_size:
            raise ValueError(f"dp_rank={dp_rank} is outside [0, {self.cfg.dp_size})")
        self._check_fits(input_ids, params, group)
        return self._submit(list(input_ids), params, return_logprob, group)

    def wait(self, rid: str) -> dict:
        """Blocks until request `rid` finishes; raises ValueError if it was rejected."""
        while rid not in self._results:
            self._receive()
        o = self._results.pop(rid)
        if o["finish_reason"]["type"] == "abort":
            raise ValueError(o["finish_reason"]["message"])
        text = self.tokenizer.decode(o["output_ids"], skip_special_tokens=True) if self.tokenizer else ""
        meta = {
            k: o[k]
            for k in (
                "prompt_tokens",
                "completion_tokens",
                "cached_tokens",
                "spec_verify_ct",
                "finish_reason",
                "dp_rank",
            )
        }
        if o["return_logprob"]:
            meta["output_token_logprobs"] = o["output_token_logprobs"]
        return {"text": text, "output_ids": o["output_ids"], "meta_info": meta}

    def get_server_info(self) -> dict:
        return server_info(self.cfg, self.dp_info)

    def get_metrics(self) -> list[dict]:
        """Per DP rank, the latest load and cache figures its leader reported (the scheduler's
        `stats()`: running, queued, KV used/free/cached, tokens prefilled and generated, cache
        hits and evictions, retractions)."""
        return [dict(self._stats[g]) for g in range(self.cfg.dp_size)]

    def get_step_log(self) -> list[list]:
        """Per DP group, the StepRecords of the steps run since the last call (then cleared)."""
        for g in range(self.cfg.dp_size):
            self.workers.send(g, {"type": "get_step_log"})
        while len(self._step_logs) < self.cfg.dp_size:
            self._receive()
        logs, self._step_logs = self._step_logs, {}
        return [logs[g] for g in range(self.cfg.dp_size)]

    def shutdown(self) -> None:
        if hasattr(self, "workers"):
            self.workers.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self) -> None:
        # At interpreter exit the modules shutdown needs may be gone; the ranks die with us anyway.
        with contextlib.suppress(Exception):
            self.shutdown()

    # --- internals --------------------------------------------------------------------------

    def _check_fits(self, input_ids: list[int], params: SamplingParams, group: int) -> None:
        """The checks the HTTP server applies: nothing invalid ever reaches a worker."""
        capacity = self.dp_info[group]["max_total_num_tokens"]
        check_request(input_ids, params, self.model_cfg.vocab_size, self.model_cfg.context_len, capacity)

    def _submit(self, input_ids: list[int], params: SamplingParams, return_logprob: bool, group: int) -> str:
        rid = uuid.uuid4().hex
        self.workers.send(group, GenerateRequest(rid, input_ids, params, return_logprob))
        return rid

    def _receive(self) -> None:
        """Takes one message from the workers; raises WorkerFailure if a rank failed or died."""
        msg = self.workers.recv()
        if msg["type"] == "step_log":
            self._step_logs[msg["dp_rank"]] = msg["steps"]
        elif msg["type"] == "step":
            self._stats[msg["dp_rank"]] = msg["stats"]
            self._results.update((o["rid"], o) for o in msg["finished"])


def _load_tokenizer(model_path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError):
        logger.warning("no tokenizer found in %s; only input_ids prompts are accepted", model_path)
        return None
