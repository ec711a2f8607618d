"""The server's front end: tokenizes, routes requests to DP groups, streams detokenized text back.

Runs in the HTTP process. A thread receives the workers' messages and hands them to the event
loop; tokenization and detokenization happen here, never in a scheduler loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from dpserve.config import EngineConfig
from dpserve.engine.engine import load_model, log_ready, server_info
from dpserve.engine.workers import WorkerFailure, WorkerSet
from dpserve.sampling_params import SamplingParams
from dpserve.scheduler.request import GenerateRequest, check_request
from dpserve.server.detokenizer import IncrementalDetokenizer
from dpserve.server.metrics import ServerMetrics
from dpserve.server.router import CacheAwarePolicy, Router

logger = logging.getLogger("dpserve.server")

RECV_TIMEOUT_MS = 200


class RequestError(ValueError):
    """The caller's mistake: reported as a 4xx JSON error."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class Submission:
    """One sequence to generate, as the HTTP layer hands it over."""

    input_ids: list[int]
    params: SamplingParams
    stop: list[str] = field(default_factory=list)
    return_logprob: bool = False
    data_parallel_rank: int | None = None


@dataclass
class Chunk:
    """What one sequence produced since the previous chunk."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: dict | None  # set on the last chunk
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache (known on the last chunk)
    spec_verify_ct: int  # speculative verify steps (known on the last chunk)
    dp_rank: int


@dataclass
class _State:
    rid: str
    group: int
    prompt_tokens: int
    detok: IncrementalDetokenizer
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    event: asyncio.Event = field(default_factory=asyncio.Event)
    pending: list[tuple[int, float]] = field(default_factory=list)
    output: dict | None = None  # the worker's final output
    finish_reason: dict | None = None
    completion_tokens: int = 0


class TokenizerManager:
    def __init__(
        self,
        cfg: EngineConfig,
        load_balance_method: str = "cache_aware",
        cache_aware: CacheAwarePolicy | None = None,
    ):
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.model_cfg = load_model(cfg)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
        self.router = Router(cfg.dp_size, load_balance_method, cache_aware)
        self.workers = WorkerSet(cfg)
        self.info = server_info(cfg, self.workers.dp_info)
        self.kv_capacity = min(d["max_total_num_tokens"] for d in self.workers.dp_info)
        log_ready(cfg, self.model_cfg, self.workers.dp_info)
        self.stats = [d["stats"] for d in self.workers.dp_info]
        self.metrics_registry = ServerMetrics(self.metrics)
        self.counters = {"requests": 0, "prompt_tokens": 0, "generation_tokens": 0, "aborted": 0}
        self.failure: str | None = None
        self.on_failure = lambda: None  # set by the server: stop serving
        self._states: dict[str, _State] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        """Starts receiving worker messages into the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._receive_loop, name="dpserve-receiver", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
        self.workers.shutdown()

    def abort_all_soon(self, message: str) -> None:
        """abort_all from any thread or signal handler: run by the event loop."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.abort_all, message)

    def abort_all(self, message: str) -> None:
        """Ends every request in flight (server shutdown) and frees their KV."""
        for state in list(self._states.values()):
            self._abort(state, message)

    # --- requests --------------------------------------------------------------------------------

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        if self.tokenizer.chat_template is None:
            raise RequestError("this model has no chat template; use /v1/completions")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenize(text, add_special_tokens=False)

    def default_max_tokens(self, prompt_len: int) -> int:
        """The most new tokens a prompt can have: up to the context length or the KV pool."""
        return max(1, min(self.model_cfg.context_len, self.kv_capacity) - prompt_len)

    def check(self, sub: Submission) -> None:
        """Raises RequestError for a request that can never run; nothing has been sent yet."""
        if self.failure is not None:
            raise RequestError(f"the server is shutting down: {self.failure}", status=503)
        m = self.model_cfg
        try:
            if sub.data_parallel_rank is not None:
                self.router.check_pin(sub.data_parallel_rank)
            check_request(sub.input_ids, sub.params, m.vocab_size, m.context_len, self.kv_capacity)
        except ValueError as e:
            raise RequestError(str(e)) from None

    async def generate(self, sub: Submission) -> AsyncIterator[Chunk]:
        """Streams one sequence's chunks. Leaving early (client gone, cancelled) aborts it."""
        self.check(sub)
        rid = uuid.uuid4().hex
        state = _State(rid, -1, len(sub.input_ids), IncrementalDetokenizer(self.tokenizer, sub.stop))
        state.group = self.router.route(rid, sub.input_ids, sub.params.max_new_tokens, sub.data_parallel_rank)
        self._states[rid] = state
        self.counters["requests"] += 1
        self.counters["prompt_tokens"] += len(sub.input_ids)
        try:
            self.workers.send(
                state.group, GenerateRequest(rid, sub.input_ids, sub.params, sub.return_logprob)
            )
            while True:
                await state.event.wait()
                state.event.clear()
                chunk = self._take(state)
                yield chunk
                if chunk.finish_reason is not None:
                    return
        finally:
            if state.finish_reason is None:
                self._abort(state, "the client went away")
            self._states.pop(rid, None)
            self.router.on_finish(rid)

    def _take(self, state: _State) -> Chunk:
        tokens = [t for t, _ in state.pending]
        logprobs = [lp for _, lp in state.pending]
        state.pending.clear()
        state.detok.add(tokens)
        if state.detok.matched_stop is not None and state.finish_reason is None:
            # The worker keeps generating until it hears of the stop string; drop those tokens.
            keep = len(state.detok.ids) - state.completion_tokens
            tokens, logprobs = tokens[:keep], logprobs[:keep]
            state.finish_reason = {"type": "stop", "matched": state.detok.matched_stop}
            self._send_abort(state)
        elif state.output is not None and state.finish_reason is None:
            state.finish_reason = state.output["finish_reason"]
        state.completion_tokens += len(tokens)
        done = state.finish_reason is not None and state.finish_reason["type"] != "abort"
        if done and state.first_token is not None and state.completion_tokens > 1:
            per_token = (time.monotonic() - state.first_token) / (state.completion_tokens - 1)
            self.metrics_registry.time_per_output_token.observe(per_token)
        return Chunk(
            text=state.detok.delta(final=state.finish_reason is not None),
            token_ids=tokens,
            logprobs=logprobs,
            finish_reason=state.finish_reason,
            prompt_tokens=state.prompt_tokens,
            completion_tokens=state.completion_tokens,
            cached_tokens=state.output["cached_tokens"] if state.output else 0,
            spec_verify_ct=state.output["spec_verify_ct"] if state.output else 0,
            dp_rank=state.group,
        )

    def _abort(self, state: _State, message: str) -> None:
        if state.finish_reason is None:
            state.finish_reason = {"type": "abort", "message": message}
            self.counters["aborted"] += 1
            self._send_abort(state)
        state.event.set()

    def _send_abort(self, state: _State) -> None:
        if self.failure is None and not self.workers.closed:
            self.workers.send(state.group, {"type": "abort", "rid": state.rid})

    # --- worker messages -------------------------------------------------------------------------

    def _receive_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                msg = self.workers.recv(timeout_ms=RECV_TIMEOUT_MS)
            except WorkerFailure as e:
                self._loop.call_soon_threadsafe(self._fail, str(e))
                return
            except RuntimeError:  # shut down
                return
            if msg is not None:
                self._loop.call_soon_threadsafe(self._dispatch, msg)

    def _dispatch(self, msg: dict) -> None:
        if msg["type"] != "step":
            return
        self.stats[msg["dp_rank"]] = msg["stats"]
        self.counters["generation_tokens"] += len(msg["tokens"])
        touched = set()
        for rid, tok, lp in msg["tokens"]:
            state = self._states.get(rid)
            if state is not None:
                if state.first_token is None:
                    state.first_token = time.monotonic()
                    self.metrics_registry.time_to_first_token.observe(state.first_token - state.arrival)
                state.pending.append((tok, lp))
                self.router.on_token(rid)
                touched.add(rid)
        for output in msg["finished"]:
            state = self._states.get(output["rid"])
            if state is not None:
                state.output = output
                touched.add(output["rid"])
        for rid in touched:
            self._states[rid].event.set()

    def _fail(self, cause: str) -> None:
        logger.error("a worker failed; the server stops: %s", cause)
        self.failure = cause.splitlines()[0]
        self.abort_all(f"the server failed: {self.failure}")
        self.on_failure()

    # --- reporting -------------------------------------------------------------------------------

    def metrics(self) -> dict:
        return {
            "time": time.time(),
            "counters": dict(self.counters),
            "dp_ranks": [
                {
                    "dp_rank": g,
                    **self.stats[g],
                    "max_total_num_tokens": self.workers.dp_info[g]["max_total_num_tokens"],
                    "outstanding_tokens": self.router.outstanding_tokens[g],
                    "inflight_requests": self.router.requests[g],
                }
                for g in range(self.cfg.dp_size)
            ],
        }
