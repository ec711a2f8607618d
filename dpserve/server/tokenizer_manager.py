"""The server's side of the front end: tokenization, incremental detokenization with stop strings,
and the asyncio plumbing that streams each sequence's chunks. Intake, routing, outputs and abort
are the shared `FrontEnd`'s.

Runs in the HTTP process. A thread receives the workers' messages and hands them to the event
loop, which applies them to the front end; (de)tokenization never runs in a scheduler loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from dpserve.config import EngineConfig
from dpserve.engine.front_end import FrontEnd, RequestState
from dpserve.engine.worker_pool import WorkerFailure
from dpserve.grammar import grammar_key
from dpserve.messages import Abort, Bootstrap, GetExpertLoad, StepReport, Stop
from dpserve.models.tokenizer import load_tokenizer
from dpserve.sampling_params import SamplingParams
from dpserve.server.detokenizer import IncrementalDetokenizer
from dpserve.server.metrics import ServerMetrics
from dpserve.server.reasoning import END

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
    grammar_after: int | None = None  # the token after which its grammar applies (reasoning's end)
    bootstrap: Bootstrap | None = None  # prefill-decode disaggregation: its other half


@dataclass
class Chunk:
    """What one sequence produced since the previous chunk."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]  # per token: the alternatives asked for (top_logprobs_num)
    finish_reason: dict | None  # set on the last chunk
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache (known from the first chunk)
    spec_verify_ct: int  # speculative verify steps (known on the last chunk)
    dp_rank: int


@dataclass
class _Stream:
    """A sequence being streamed: its front-end state and what the HTTP side adds."""

    state: RequestState
    detok: IncrementalDetokenizer
    event: asyncio.Event = field(default_factory=asyncio.Event)
    finish_reason: dict | None = None
    completion_tokens: int = 0
    first_token_seen: bool = False


class TokenizerManager:
    def __init__(self, cfg: EngineConfig):
        self.front = FrontEnd(cfg)
        self.cfg, self.model_cfg = self.front.cfg, self.front.model_cfg
        try:
            self.tokenizer = load_tokenizer(self.cfg.model_path)
        except (OSError, ValueError) as e:  # none there, or one only its own code reads (Kimi's tiktoken)
            self.front.shutdown()
            raise ValueError(
                f"{self.cfg.model_path}: its tokenizer cannot be loaded without running code shipped with "
                f"the checkpoint ({str(e).splitlines()[0]}); the server needs it (the offline Engine serves "
                "input_ids without one)"
            ) from None
        self.info = self.front.server_info()
        self.metrics_registry = ServerMetrics(self.front.metrics)
        self.failure: str | None = None
        self.on_failure = lambda: None  # set by the server: stop serving
        self._streams: dict[str, _Stream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._tasks: set[asyncio.Task] = set()  # kept referenced until the loop ends
        self._asking = asyncio.Lock()  # one question to the group leaders at a time
        self._answered: asyncio.Event | None = None

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
        self.front.shutdown()

    def abort_all_soon(self, message: str) -> None:
        """abort_all from any thread or signal handler: run by the event loop."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.abort_all, message)

    def run_soon(self, coroutine_fn) -> None:
        """Runs `coroutine_fn()` as a task of the event loop, from any thread or signal handler."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(lambda: self._tasks.add(self._loop.create_task(coroutine_fn())))

    def abort_all(self, message: str) -> None:
        """Ends every request in flight (server shutdown) and frees their KV."""
        for stream in list(self._streams.values()):
            self._abort(stream, message)

    # --- requests --------------------------------------------------------------------------------

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def chat_prompt(self, messages: list[dict], continue_final: bool = False, **template_kwargs) -> list[int]:
        """The chat template's prompt: opening the assistant's turn, or with `continue_final`
        continuing the last (assistant) message."""
        if self.tokenizer.chat_template is None:
            raise RequestError("this model has no chat template; use /v1/completions")
        text = self.tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=not continue_final,
            continue_final_message=continue_final,
            tokenize=False,
            **template_kwargs,
        )
        return self.tokenize(text, add_special_tokens=False)

    def think_end_id(self) -> int:
        """The token that ends a reply's reasoning (</think>), for a grammar that applies after it."""
        ids = self.tokenizer.encode(END, add_special_tokens=False)
        if len(ids) != 1:
            raise RequestError(
                f"structured output with --reasoning-parser needs {END} to be one token of the "
                f"vocabulary; this tokenizer writes it as {len(ids)}"
            )
        return ids[0]

    def default_max_tokens(self, prompt_len: int) -> int:
        """The most new tokens a prompt can have: up to the context length or the KV pool."""
        return max(1, min(self.model_cfg.context_len, self.front.kv_capacity) - prompt_len)

    def bootstraps(self, body, count: int) -> list[Bootstrap | None]:
        """The PD router's bootstrap fields of `body` (a request model) for its `count` sequences."""
        try:
            return body.bootstraps(count, self.cfg.disaggregation_bootstrap_port)
        except ValueError as e:
            raise RequestError(str(e)) from None

    async def check(self, sub: Submission) -> None:
        """Raises RequestError for a request that can never run; nothing has been sent yet. The one
        check of a request (`generate` takes it checked); a grammar's text is parsed off the event
        loop (a large schema takes a while, and every other client waits on the loop)."""
        self._alive()
        check = (sub.input_ids, sub.params, sub.data_parallel_rank, sub.bootstrap)
        try:
            if grammar_key(sub.params) is None:
                self.front.check(*check)
            else:
                await asyncio.to_thread(self.front.check, *check)
        except ValueError as e:
            raise RequestError(str(e)) from None

    def _alive(self) -> None:
        if self.failure is not None:
            raise RequestError(f"the server is shutting down: {self.failure}", status=503)

    async def generate(self, sub: Submission) -> AsyncIterator[Chunk]:
        """Streams one sequence's chunks (`check`ed already). Leaving early (client gone,
        cancelled) aborts it."""
        self._alive()
        state = self.front.send(
            sub.input_ids,
            sub.params,
            sub.return_logprob,
            sub.data_parallel_rank,
            sub.grammar_after,
            sub.bootstrap,
        )
        stream = _Stream(state, IncrementalDetokenizer(self.tokenizer, sub.stop, sub.params))
        self._streams[state.rid] = stream
        try:
            while True:
                await stream.event.wait()
                stream.event.clear()
                chunk = self._take(stream)
                yield chunk
                if chunk.finish_reason is not None:
                    return
        finally:
            if stream.finish_reason is None:
                self._abort(stream, "the client went away")
            self._streams.pop(state.rid, None)
            self.front.release(state.rid)

    def _take(self, stream: _Stream) -> Chunk:
        state = stream.state
        tokens = [t.token for t in state.new]
        logprobs = [t.logprob for t in state.new]
        tops = [t.top for t in state.new]
        state.new.clear()
        stream.detok.add(tokens)
        if stream.detok.matched_stop is not None and stream.finish_reason is None:
            # The worker keeps generating until it hears of the stop string; drop those tokens.
            keep = len(stream.detok.ids) - stream.completion_tokens
            tokens, logprobs, tops = tokens[:keep], logprobs[:keep], tops[:keep]
            stream.finish_reason = Stop(stream.detok.matched_stop).wire()
            self.front.abort(state.rid)
        elif state.output is not None and stream.finish_reason is None:
            stream.finish_reason = state.output.finish_reason.wire()
        stream.completion_tokens += len(tokens)
        done = stream.finish_reason is not None and stream.finish_reason["type"] != "abort"
        if done and state.first_token is not None and stream.completion_tokens > 1:
            per_token = (time.monotonic() - state.first_token) / (stream.completion_tokens - 1)
            self.metrics_registry.time_per_output_token.observe(per_token)
        return Chunk(
            text=stream.detok.delta(final=stream.finish_reason is not None),
            token_ids=tokens,
            logprobs=logprobs,
            top_logprobs=tops,
            finish_reason=stream.finish_reason,
            prompt_tokens=state.prompt_tokens,
            completion_tokens=stream.completion_tokens,
            cached_tokens=state.cached_tokens,
            spec_verify_ct=state.output.spec_verify_ct if state.output else 0,
            dp_rank=state.dp_rank,
        )

    def _abort(self, stream: _Stream, message: str) -> None:
        if stream.finish_reason is None:
            stream.finish_reason = Abort(message).wire()
            if self.failure is None:
                self.front.abort(stream.state.rid)
        stream.event.set()

    async def expert_load(self) -> list[list[int]]:
        """Rows routed to each expert of each MoE layer since the last dump (then cleared), as every
        group leader counted them (POST /dump_expert_load)."""
        if self.model_cfg.moe is None:
            raise RequestError(f"{self.model_cfg.arch} has no routed experts: there is no expert load")
        async with self._asking:
            self._answered = asyncio.Event()
            self.front.send_question(GetExpertLoad())
            await self._answered.wait()
            self._answered = None
            if self.failure is not None:
                raise RequestError(f"the server failed: {self.failure}", 503)
            return self.front.total_expert_load(self.front.take_replies())

    # --- worker messages -------------------------------------------------------------------------

    def _receive_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                msg = self.front.recv(timeout_ms=RECV_TIMEOUT_MS)
            except WorkerFailure as e:
                if not self._stopping.is_set():  # else the event loop may be closed already
                    self._loop.call_soon_threadsafe(self._fail, str(e))
                return
            except RuntimeError:  # shut down
                return
            if msg is not None:
                self._loop.call_soon_threadsafe(self._dispatch, msg)

    def _dispatch(self, msg: object) -> None:
        if isinstance(msg, StepReport):
            for value in msg.expert_imbalance:
                self.metrics_registry.expert_imbalance.labels(str(msg.dp_rank)).observe(value)
            for rebalance in msg.rebalances:
                self.metrics_registry.observe_rebalance(msg.dp_rank, rebalance)
        for state in self.front.apply(msg):
            stream = self._streams.get(state.rid)
            if stream is None:
                continue
            if state.first_token is not None and not stream.first_token_seen:
                stream.first_token_seen = True
                self.metrics_registry.time_to_first_token.observe(state.first_token - state.arrival)
            stream.event.set()
        if self._answered is not None and self.front.answered:
            self._answered.set()

    def _fail(self, cause: str) -> None:
        logger.error("a worker failed; the server stops: %s", cause)
        self.failure = cause.splitlines()[0]
        if self._answered is not None:
            self._answered.set()
        self.abort_all(f"the server failed: {self.failure}")
        self.on_failure()
