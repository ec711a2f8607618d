"""The front end: the one place requests enter and results leave, shared by the offline `Engine`
and the HTTP server (which adds only HTTP, tokenization and streaming).

It starts the workers, checks a request before anything reaches them, routes it to a DP group
(`Router`: --load-balance-method, or the request's pinned data_parallel_rank), applies the
workers' step reports to each request's state (new tokens, the final output), aborts, and keeps
the per-group load figures behind routing, `get_server_info` and /metrics.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass, field

from dpserve.config import EngineConfig
from dpserve.disagg.bootstrap import PrefillBootstrap
from dpserve.engine.router import Router
from dpserve.engine.worker_pool import WorkerPool, prepared
from dpserve.grammar import check_grammar
from dpserve.memory import RANK_FIGURES
from dpserve.messages import (
    Abort,
    AbortRequest,
    Bootstrap,
    ExpertLoad,
    FirstToken,
    FlushCache,
    GenerateRequest,
    GetExpertLoad,
    GetStepLog,
    KVDestination,
    PrefillFailed,
    RequestOutput,
    RoomCancel,
    StepRecords,
    StepReport,
    TokenOut,
)
from dpserve.models.checkpoint import CheckpointReader
from dpserve.models.config import ModelConfig
from dpserve.sampling_params import SamplingParams
from dpserve.scheduler.request import check_request

logger = logging.getLogger("dpserve")

UNHEALTHY_AFTER = 3  # KV transfers failed in a row before /health says so


@dataclass
class RequestState:
    """One sequence in flight, as the front end sees it."""

    rid: str
    dp_rank: int
    prompt_tokens: int
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None  # when its first token arrived
    cached_tokens: int = 0  # prompt tokens its group found in the prefix cache (known at admission)
    new: list[TokenOut] = field(default_factory=list)  # tokens not taken yet
    output: RequestOutput | None = None  # the worker's final output: the request is done
    room: int | None = None  # prefill-decode disaggregation: its bootstrap room


def load_model_config(cfg: EngineConfig) -> ModelConfig:
    """Reads and checks the model config against the layout, before any process starts."""
    model_cfg = ModelConfig.load(cfg.model_path, cfg.quantization)
    CheckpointReader(cfg.model_path)  # its weights are there (an error names the folder)
    model_cfg.validate(cfg)
    if cfg.nextn:
        model_cfg.check_mtp()
    return model_cfg


class FrontEnd:
    def __init__(self, cfg: EngineConfig):
        for warning in cfg.ignored_options():
            logger.warning("%s", warning)
        self.cfg = cfg = prepared(cfg)
        self.model_cfg = load_model_config(cfg)
        self.router = Router(cfg)
        self.workers = WorkerPool(cfg)
        self.dp_info = [ready.figures for ready in self.workers.ready]  # per DP group, from its leader
        self.stats = [ready.stats for ready in self.workers.ready]  # each group's latest report
        self.kv_capacity = min(info["max_total_num_tokens"] for info in self.dp_info)
        self.counters = {"requests": 0, "prompt_tokens": 0, "generation_tokens": 0, "aborted": 0}
        self.requests: dict[str, RequestState] = {}
        self.replies: dict[int, object] = {}  # group leaders' answers to `ask`
        self.rooms: dict[int, str] = {}  # prefill-decode disaggregation: bootstrap room -> request
        self.transfer_failures, self.transfer_error = 0, ""  # KV writes failed since the last that worked
        self.bootstrap = None
        if cfg.disaggregation_mode == "prefill":
            try:
                self.bootstrap = PrefillBootstrap(
                    cfg.disaggregation_bootstrap_port, cfg.disaggregation_timeout, self.workers.collector
                )
            except ValueError:
                self.workers.shutdown()
                raise
        self._log_ready()

    def check(
        self,
        input_ids: list[int],
        params: SamplingParams,
        dp_rank: int | None = None,
        bootstrap: Bootstrap | None = None,
    ) -> None:
        """Raises ValueError, naming the numbers, for a request that can never run: the one check a
        request passes (the server's and the offline Engine's), before anything is sent."""
        m = self.model_cfg
        if dp_rank is not None:
            self.router.check_pin(dp_rank)
        self._check_bootstrap(bootstrap)
        check_request(input_ids, params, m.vocab_size, m.context_len, self.kv_capacity)
        check_grammar(params, self.cfg.grammar_backend)

    def submit(self, input_ids: list[int], params: SamplingParams, **send_args) -> RequestState:
        """Checks, routes and sends one sequence (`send`'s arguments); its state fills in as the
        workers report."""
        self.check(input_ids, params, send_args.get("dp_rank"), send_args.get("bootstrap"))
        return self.send(input_ids, params, **send_args)

    def send(
        self,
        input_ids: list[int],
        params: SamplingParams,
        return_logprob: bool = False,
        dp_rank: int | None = None,
        grammar_after: int | None = None,
        bootstrap: Bootstrap | None = None,
    ) -> RequestState:
        """Routes and sends one sequence `check` passed already (callers that check a whole batch
        before sending any of it, as the server and the offline Engine do, check each sequence
        once). `grammar_after`: the token after which the request's grammar applies (reasoning's
        end); `bootstrap`: its other half under prefill-decode disaggregation."""
        rid = uuid.uuid4().hex
        if self.bootstrap is not None:  # prefill: the prompt and its first token, then the KV moves
            params = dataclasses.replace(
                params, max_new_tokens=1, min_new_tokens=min(params.min_new_tokens, 1)
            )
        group = self.router.route(rid, input_ids, params.max_new_tokens, dp_rank)
        state = RequestState(rid, group, len(input_ids))
        self.requests[rid] = state
        self.counters["requests"] += 1
        self.counters["prompt_tokens"] += len(input_ids)
        if bootstrap is not None:
            state.room = bootstrap.room
            self.rooms[bootstrap.room] = rid
            if self.bootstrap is not None:
                self.bootstrap.add(bootstrap.room, rid)
        msg = GenerateRequest(rid, list(input_ids), params, return_logprob, grammar_after, bootstrap)
        self.workers.send(group, msg, wake_all=True)
        return state

    def _check_bootstrap(self, bootstrap: Bootstrap | None) -> None:
        mode = self.cfg.disaggregation_mode
        if mode == "null" and bootstrap is not None:
            raise ValueError(
                "bootstrap_room is for prefill-decode disaggregation; this server runs with "
                "--disaggregation-mode null"
            )
        if mode != "null" and bootstrap is None:
            raise ValueError(
                f"this is a {mode} instance of prefill-decode disaggregation: requests come through the "
                "PD router, with bootstrap_host, bootstrap_port and bootstrap_room"
            )
        if bootstrap is not None:
            if bootstrap.room in self.rooms:
                raise ValueError(f"bootstrap_room {bootstrap.room} is already in use on this {mode} instance")
            if self.bootstrap is not None:
                self.bootstrap.check(bootstrap.room)

    def abort(self, rid: str, message: str = "aborted") -> None:
        """Asks the request's group to stop it and free its KV (its final output still arrives)."""
        state = self.requests.get(rid)
        if state is not None and state.output is None and not self.workers.closed:
            self.counters["aborted"] += 1
            self.workers.send(state.dp_rank, AbortRequest(rid, message))

    def release(self, rid: str) -> None:
        """Forgets a request (finished, or given up by its caller)."""
        if self.requests.pop(rid, None) is not None:
            self.router.on_finish(rid)

    def recv(self, timeout_ms: int | None = None) -> object | None:
        """The next worker message (None after `timeout_ms`); raises WorkerFailure."""
        return self.workers.recv(timeout_ms)

    def apply(self, msg: object) -> list[RequestState]:
        """Applies a worker message (or the bootstrap endpoint's); returns the requests it changed."""
        match msg:
            case KVDestination(rid=rid) if rid in self.requests:
                self.workers.send(self.requests[rid].dp_rank, msg)
            case RoomCancel(rid=rid, message=message) if rid in self.requests:
                self.abort(rid, message)
            case StepRecords(dp_rank=g, steps=reply) | ExpertLoad(dp_rank=g, load=reply):
                self.replies[g] = reply
            case StepReport():
                return self._apply_step(msg)
        return []

    def _apply_step(self, msg: StepReport) -> list[RequestState]:
        self.stats[msg.dp_rank] = msg.stats
        self.counters["generation_tokens"] += len(msg.tokens)
        touched = {}
        now = time.monotonic()
        for rid, cached in msg.cached:
            if rid in self.requests:
                self.requests[rid].cached_tokens = cached
        for token in msg.tokens:
            state = self.requests.get(token.rid)
            if state is not None:
                state.first_token = state.first_token or now
                state.new.append(token)
                self.router.on_token(token.rid)
                touched[token.rid] = state
        for output in msg.finished:
            state = self.requests.get(output.rid)
            if state is not None:
                state.output = output
                touched[output.rid] = state
                if state.room is not None:
                    self._room_done(state.room, output)
        return list(touched.values())

    def _room_done(self, room: int, output: RequestOutput) -> None:
        """Counts the room's KV write as failed or done; on a prefill instance, tells the decode side
        the room's first token, or why there is none."""
        self.rooms.pop(room, None)
        reason = output.finish_reason
        failed = isinstance(reason, Abort)
        if failed and reason.write_failed:
            self.transfer_failures, self.transfer_error = self.transfer_failures + 1, reason.message
        elif not failed:
            self.transfer_failures = 0
        if self.bootstrap is None:
            return
        if failed:
            error = f"the prefill instance failed the request: {reason.message}"
            self.bootstrap.done(room, PrefillFailed(error, bool(reason.write_failed)))
            return
        logprobs, tops = output.output_token_logprobs, output.output_top_logprobs
        first = FirstToken(
            output.output_ids[0], logprobs[0] if logprobs else 0.0, tops[0] if tops else [], output.drafts
        )
        self.bootstrap.done(room, first)

    def health(self) -> str | None:
        """What keeps this instance from serving prefill-decode requests (None: nothing)."""
        if self.bootstrap is not None and not self.bootstrap.alive:
            return "the bootstrap endpoint stopped"
        if self.transfer_failures >= UNHEALTHY_AFTER:
            return f"the last {self.transfer_failures} KV transfers failed, the latest: {self.transfer_error}"
        return None

    def ask(self, question: GetStepLog | GetExpertLoad) -> list:
        """Every group leader's reply to `question`, in DP-rank order; each leader clears what it
        sent. The server, whose receiver thread applies every message, sends the question and takes
        the replies once `answered`."""
        self.send_question(question)
        while not self.answered:
            self.apply(self.recv())
        return self.take_replies()

    def send_question(self, question: GetStepLog | GetExpertLoad) -> None:
        for g in range(self.cfg.dp_size):
            self.workers.send(g, question)

    @property
    def answered(self) -> bool:
        return len(self.replies) == self.cfg.dp_size

    def take_replies(self) -> list:
        replies, self.replies = self.replies, {}
        return [replies[g] for g in range(self.cfg.dp_size)]

    def flush_cache(self) -> None:
        """Empties every group's prefix cache of the entries no running request holds, and the
        routing trees that follow them (POST /flush_cache)."""
        for g in range(self.cfg.dp_size):
            self.workers.send(g, FlushCache())
        self.router.flush()

    def get_step_logs(self) -> list[list]:
        """Per DP group, the StepRecords of the steps run since the last call (then cleared)."""
        return self.ask(GetStepLog())

    def get_expert_load(self) -> list[list[int]]:
        """Rows routed to each expert of each MoE layer since the last call, [layers][experts]."""
        return self.total_expert_load(self.ask(GetExpertLoad()))

    def total_expert_load(self, loads: list) -> list[list[int]]:
        """The instance's rows per expert from every leader's reply: under DP attention each leader
        counted every group's rows; replicas count their own."""
        return (loads[0] if self.cfg.enable_dp_attention else sum(loads)).tolist()

    def server_info(self) -> dict:
        """Every option (as SGLang reports its server args), the derived layout, and per DP group
        its KV pool and memory figures."""
        cfg = self.cfg
        ranks = [{"dp_rank": g, **{k: info[k] for k in RANK_FIGURES}} for g, info in enumerate(self.dp_info)]
        return {
            **dataclasses.asdict(cfg),
            "attn_tp_size": cfg.attn_tp_size,
            "running_per_group": cfg.running_per_group,
            "chunk_per_group": cfg.chunk_per_group,
            "graph_buckets": cfg.graph_buckets,
            "radix_cache": not cfg.disable_radix_cache,
            "overlap_schedule": cfg.overlap_schedule,
            "dp_ranks": ranks,
        }

    def metrics(self) -> dict:
        """Counters, and per DP group its leader's latest figures and the router's load."""
        return {
            "time": time.time(),
            "counters": dict(self.counters),
            "dp_ranks": [
                {
                    "dp_rank": g,
                    **self.stats[g],
                    "max_total_num_tokens": self.dp_info[g]["max_total_num_tokens"],
                    "window_tokens": self.dp_info[g]["window_tokens"],
                    "outstanding_tokens": self.router.outstanding_tokens[g],
                    "inflight_requests": self.router.requests[g],
                }
                for g in range(self.cfg.dp_size)
            ],
        }

    def shutdown(self) -> None:
        if self.bootstrap is not None:
            self.bootstrap.close()
        self.workers.shutdown()

    def _log_ready(self) -> None:
        cfg, per_group = self.cfg, self.dp_info[0]["max_total_num_tokens"]
        spec = "off"
        if cfg.speculative_algorithm:
            spec = f"{cfg.speculative_algorithm}, {cfg.speculative_num_steps} draft(s) per request and step"
        overlap = "on" if cfg.overlap_schedule else f"off ({cfg.overlap_off}: host work after each forward)"
        logger.info(
            "ready: %s tp=%d dp=%d (%s) attention TP=%d, %d ranks per node on %d node(s), %s on %s (%s "
            "attention); KV %d tokens per DP group (%d bytes/token), %d for the instance; prefill budget %d "
            "tokens per group, %d global; speculative decoding %s; overlap scheduling %s",
            self.model_cfg.arch,
            cfg.tp_size,
            cfg.dp_size,
            "DP attention" if cfg.enable_dp_attention else f"{cfg.num_instances} replica(s)",
            cfg.attn_tp_size,
            cfg.ranks_per_node,
            cfg.nnodes,
            cfg.dtype,
            cfg.device,
            cfg.attention_backend,
            per_group,
            self.dp_info[0]["kv_bytes_per_token"],
            per_group * cfg.dp_size,
            cfg.chunk_per_group,
            cfg.chunk_per_group * cfg.dp_size,
            spec,
            overlap,
        )
