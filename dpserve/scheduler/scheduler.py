"""Continuous batching for one DP group, run by the group's attn_tp_rank 0 (docs/design.md, section 5).

Memory is taken on demand. A request is admitted when its uncached prompt plus an estimate of
its decode tokens fits (`new_token_ratio` of what it may still generate: it decays while memory
is plentiful and jumps back after a retraction); decode slots are taken step by step. When a
step cannot get its decode slots, unlocked prefix-cache entries are evicted, then running
requests are retracted (fewest generated tokens first; ties: longest prompt): a retracted
request frees its KV (its prefix stays cached), goes back to the front of the queue and resumes
by prefilling prompt + generated tokens, so its output is unchanged. A request retracted
`MAX_RETRACTIONS` times is next admitted with its whole need reserved and never retracted again,
so every request finishes.

Each step prefills up to `chunk_size` prompt tokens (continuing a chunked prompt first), and
every request already decoding rides along with one token. With speculative decoding, a
decoding request also feeds up to `num_drafts` proposed tokens (NGRAM: prompt lookup; NEXTN: the
MTP layer's chain from the previous step), from the slots the step leaves spare (speculation
never retracts anyone); the model verifies them in the same step, and the slots of the drafts it
rejects are freed at once. With NEXTN a prefix-cache hit leaves its last token to recompute: the
MTP layer pairs a position's hidden state with the token after it, so the hit's last position
needs its hidden state, which the cache does not keep.
"""

from __future__ import annotations

import logging
import random
from collections import deque
from dataclasses import replace

from dpserve.disagg.queues import Limbo, SendQueue
from dpserve.grammar import COUNTERS as GRAMMAR_COUNTERS
from dpserve.grammar import GrammarCache, Matcher, grammar_key
from dpserve.messages import (
    Abort,
    Destination,
    FinishReason,
    FirstToken,
    GenerateRequest,
    Length,
    RequestOutput,
    Stop,
    TokenOut,
)
from dpserve.scheduler.cache_manager import CacheManager
from dpserve.scheduler.request import Req, ReqStatus, max_kv_len
from dpserve.scheduler.scheduled import ScheduledStep
from dpserve.speculative.ngram import propose_ngram
from dpserve.step.records import PENDING_TOKEN, BatchKind, BatchReq, KVSend

logger = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = (INIT_NEW_TOKEN_RATIO - MIN_NEW_TOKEN_RATIO) / 600  # per step without retraction
NEW_TOKEN_RATIO_STEP_UP = 0.1  # after a retraction at or above the initial ratio
ESTIMATE_CLIP = 4096  # decode tokens counted per request in the estimate (as SGLang)
MAX_RETRACTIONS = 3
# A group's running totals (in get_metrics and /metrics).
COUNTERS = (
    "generated_tokens",
    "prefilled_tokens",
    "retractions",
    "cache_hit_tokens",
    "cache_evicted_tokens",
    "spec_verify_steps",  # request-steps decoded with speculation on
    "spec_draft_tokens",  # drafts proposed
    "spec_accepted_tokens",  # drafts the model agreed with
)
GRAMMAR_ERROR = 422  # the status of a request whose grammar refused a sampled token ("grammar_error")


def grammar_refused(tok: int, position: int) -> Abort:
    """The end of a request whose grammar refused a token its mask had allowed (a fault of the
    grammar engine, not of the request or the server): its output stops before that token."""
    message = f"the grammar refused token {tok} at output position {position}; the output ends before it"
    return Abort(message, GRAMMAR_ERROR)


def largest_step(
    chunk_size: int, max_running: int, num_drafts: int, context_len: int
) -> tuple[list[int], int]:
    """The largest step a group's scheduler can form, for the start-up activation peak: (prompt
    tokens of each prefilling request, decoding requests). Up to `chunk_size` prompt tokens over k
    requests (at most `context_len` each) while every other running request decodes 1 + `num_drafts`
    tokens, for the worst k."""
    steps = (
        ([min(context_len, chunk_size - i * context_len) for i in range(k)], max_running - k)
        for k in range(min(max_running, -(-chunk_size // context_len)) + 1)
    )
    return max(steps, key=lambda s: sum(s[0]) + s[1] * (1 + num_drafts))


class Scheduler:
    def __init__(
        self,
        dp_rank: int,
        kv_capacity: int,
        max_running: int,
        chunk_size: int,
        context_len: int,
        vocab_size: int,
        eos_ids: tuple[int, ...],
        seed: int,
        radix_cache: bool = True,
        num_drafts: int = 0,  # speculative tokens per decoding request and step; 0: off
        speculative_algorithm: str = "NGRAM",  # NGRAM or NEXTN (drafts handed in by `set_drafts`)
        grammars: GrammarCache | None = None,  # structured output; None: --grammar-backend none
        window_size: int = 0,  # the hybrid sliding-window pool's window (0: no such pool)
        window_capacity: int = 0,  # its slots
        disaggregation: str = "null",  # prefill-decode disaggregation: this instance's role
    ):
        self.dp_rank, self.num_drafts = dp_rank, num_drafts
        self.nextn = num_drafts > 0 and speculative_algorithm == "NEXTN"
        self.max_running, self.chunk_size = max_running, chunk_size
        self.context_len, self.vocab_size = context_len, vocab_size
        self.eos_ids = set(eos_ids)
        self.grammars = grammars
        self.disaggregation = disaggregation
        # Prefill: requests whose first token is out, holding their KV until it is written to the
        # decode side (with the finish reason they then report), and where each one's KV goes.
        self.sending: SendQueue[Req] = SendQueue()
        # Decode: slots of ended requests the prefill side may still write into.
        self.limbo = Limbo()
        self.free_table_rows = list(range(max_running, 0, -1))  # row 0 is the padding row
        self.seeds = random.Random(seed + dp_rank)  # of requests without their own
        self.reqs: dict[str, Req] = {}  # every live request, by id
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.kv = CacheManager(kv_capacity, radix_cache, window_size, window_capacity, self.counters)

    # --- requests in and out ---------------------------------------------------------------------

    def add(self, msg: GenerateRequest) -> RequestOutput | None:
        """Queues a request, which the front end checked (`request.check_request`); returns an error
        output if it cannot run here."""
        seed = self.seeds.getrandbits(64) if msg.params.seed is None else msg.params.seed
        max_len = max_kv_len(len(msg.input_ids), msg.params, self.context_len)
        req = Req(msg.rid, msg.input_ids, msg.params, msg.return_logprob, max_len, seed)
        req.grammar_after = msg.grammar_after
        req.bootstrap = msg.bootstrap
        req.kv_from_prefill = msg.bootstrap is not None and self.disaggregation == "decode"
        key = grammar_key(msg.params)
        if key is not None:
            if self.grammars is None:
                return self._output(req, Abort("no grammar backend", 400))
            req.compiled = self.grammars.get(key)  # compiled meanwhile: the request waits, not the batch
        self.waiting.append(req)
        self.reqs[req.rid] = req
        return None

    def abort(self, rid: str, message: str = "aborted") -> RequestOutput | None:
        req = self.reqs.get(rid)
        return None if req is None else self._finish(req, Abort(message))

    # --- prefill-decode disaggregation -----------------------------------------------------------

    def set_destination(self, rid: str, dest: Destination) -> None:
        """Prefill: where `rid`'s KV goes (written once its first token is out)."""
        if rid in self.reqs:
            self.sending.set_destination(rid, dest)

    def sent(self, step: ScheduledStep, errors: list[str | None]) -> list[RequestOutput]:
        """Prefill: `step`'s sends are done (or failed: their error); their requests end."""
        out = []
        for rid, error in zip(step.sends, errors, strict=True):
            held = self.sending.pop(rid)
            if held is None:  # aborted meanwhile
                continue
            req, reason = held
            if error is not None:
                message = f"writing the KV failed: {error}"
                reason = Abort(message, 500, write_failed=True)
            drafts = req.proposed  # NEXTN: the MTP layer's first chain, for the decode side to verify
            out.append(replace(self._finish(req, reason), drafts=drafts))
        return out

    def kv_arrived(self, rid: str, first: FirstToken) -> tuple[list[TokenOut], list[RequestOutput]]:
        """Decode: the prefill side wrote `rid`'s prompt KV (with NEXTN its MTP layer's too) and
        sampled its first token (and drafted its first chain): it decodes from its next step.
        Returns its token as process_samples does, and its output if that token ends it."""
        req = self._awaiting(rid)
        if req is None:
            return [], []
        req.kv_from_prefill, req.status = False, ReqStatus.RUNNING
        req.proposed = list(first.drafts) if self.nextn else []
        req.prefix_pending = True  # its next step writes the prompt's slots into its table row
        self.kv.cache(req)
        token = first.token
        if not self._grammar_accepts(req, token):
            return [], [self._finish(req, grammar_refused(token, 0))]
        reason = self._take_token(req, token, first.logprob, first.top)
        self.counters["generated_tokens"] += 1
        new = [TokenOut(rid, token, first.logprob, first.top)]
        if reason is not None:
            return new, [self._finish(req, reason)]
        return new, []

    def kv_failed(self, rid: str, message: str, write_failed: bool = False) -> RequestOutput | None:
        """Decode: `rid`'s KV will not come (`write_failed`: the prefill side could not write it);
        it fails with 503 naming why."""
        req = self._awaiting(rid)
        if req is None:
            return None
        reason = Abort(message, 503, write_failed=write_failed)
        return self._finish(req, reason)

    def _awaiting(self, rid: str) -> Req | None:
        """Decode: the admitted request `rid` while it awaits its KV."""
        req = self.reqs.get(rid)
        return req if req is not None and req.status is ReqStatus.AWAITING_KV else None

    def free_limbo(self, rid: str) -> None:
        """Decode: the prefill side will not write into the ended request `rid`'s slots any more."""
        self.kv.free(*self.limbo.take(rid))

    # --- scheduling ------------------------------------------------------------------------------

    def schedule(self) -> ScheduledStep:
        """The next step: chunks of prompts (a chunked one first, then admissions in order) and every
        decoding request's token and drafts."""
        step = ScheduledStep()
        decoding = self._make_room(
            step,
            [r for r in self.running if r.prefill_done and r.status is ReqStatus.RUNNING and not r.ending],
        )
        budget = self.chunk_size
        for req in [r for r in self.running if not r.prefill_done]:  # a chunked prompt continues first
            budget -= self._add_chunk(step, req, budget, reserved=len(decoding))
        for req in list(self.waiting):  # in order; those whose grammar is being compiled wait aside
            if budget <= 0 or len(self.running) + len(self.sending) >= self.max_running:
                break
            if req.in_flight or not self._grammar_ready(step, req):  # retracted, its token still coming
                continue
            if not self._admit(step, req, reserved=len(decoding)):
                break
            self.waiting.remove(req)
            if (
                req.status is ReqStatus.AWAITING_KV
            ):  # decode: its prompt's slots, for the prefill side to fill
                self.kv.reserve(req)
                step.reserved.append(req)
                continue
            budget -= self._add_chunk(step, req, budget, reserved=len(decoding))
        spare = self.kv.available - len(decoding)
        for req in decoding:
            spare -= self._add_decode(step, req, spare)
        batch = step.batch
        ready = self.sending.ready()
        step.sends = [rid for rid, _, _ in ready]
        batch.sends = [KVSend(req.slots, dest, self.kv.window_slots(req)) for _, req, dest in ready]
        if step.prefilled:
            batch.kind = BatchKind.EXTEND
        elif decoding:
            batch.kind = BatchKind.VERIFY if any(r.verify for r in batch.reqs) else BatchKind.DECODE
        if step.retractions:
            self.new_token_ratio = min(
                1.0, max(INIT_NEW_TOKEN_RATIO, self.new_token_ratio + NEW_TOKEN_RATIO_STEP_UP)
            )
        elif batch.reqs:
            self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        for req in step.sampled:
            req.in_flight += 1
        for req in step.prefilled:  # later steps may start on them: their KV is written before they run
            self.kv.cache(req)
        return step

    def _add_decode(self, step: ScheduledStep, req: Req, spare: int) -> int:
        """Adds a decoding request's last token (the one in flight, if the step before samples it) and
        its drafts (up to `spare` of them); returns the drafts added."""
        req.drafts = self._propose(req, spare)
        last = PENDING_TOKEN if req.in_flight else req.output_ids[-1]
        start, tokens = req.kv_len, [last, *req.drafts]
        prefix, slots, window_slots = self.kv.extend(req, len(tokens))
        step.batch.reqs.append(
            BatchReq(req.table_row, start, tokens, slots, True, prefix, bool(req.drafts), window_slots)
        )
        step.reqs.append(req)
        req.spec_verify_ct += self.num_drafts > 0
        self.counters["spec_verify_steps"] += self.num_drafts > 0
        return len(req.drafts)

    def _grammar_ready(self, step: ScheduledStep, req: Req) -> bool:
        """Whether `req` may be admitted: it has no grammar, or its grammar is compiled (its matcher
        is made then). A grammar that failed to compile ends the request."""
        if req.compiled is None or req.matcher is not None:
            return True
        if not req.compiled.done():
            return False
        error = req.compiled.exception()
        if error is not None:
            reason = Abort(f"the grammar did not compile: {error}", 400)
            step.failed.append(self._finish(req, reason))
            return False
        # EOS ends a grammar even with ignore_eos: the model, not the first chance, decides the end.
        req.matcher = Matcher(req.compiled.result(), sorted(self.eos_ids | set(req.params.stop_token_ids)))
        return True

    @property
    def compiling(self) -> bool:
        """Whether a queued request waits for its grammar."""
        return any(r.compiled is not None and not r.compiled.done() for r in self.waiting)

    def _propose(self, req: Req, spare: int) -> list[int]:
        """Draft tokens for `req`: no more than the spare slots, nor than it may still generate
        beyond the token the step yields anyway."""
        n = min(self.num_drafts, spare, req.remaining_new_tokens - 1)
        if n <= 0:
            return []
        drafts = req.proposed[:n] if self.nextn else propose_ngram(req.fill_ids, n)
        self.counters["spec_draft_tokens"] += len(drafts)
        return drafts

    def flush_cache(self) -> None:
        """Evicts every prefix-cache entry no running request holds."""
        self.kv.flush()

    def _estimate(self, req: Req) -> int:
        """Slots a running request is expected to take from now on: the rest of its prefill and a
        share of its decode budget."""
        return max(0, req.prefill_len - req.kv_len) + self._estimate_decode(req)

    def _estimate_decode(self, req: Req) -> int:
        decode = req.remaining_new_tokens
        return decode if req.protected else int(min(decode, ESTIMATE_CLIP) * self.new_token_ratio)

    def _make_room(self, step: ScheduledStep, decoding: list[Req]) -> list[Req]:
        """Retracts running requests until every request in `decoding` can get its slot this step;
        returns those still running."""
        while self.kv.available < len(decoding):
            victims = [
                r for r in self.running if not r.protected and r.status is ReqStatus.RUNNING and not r.ending
            ]
            if not victims:  # protected requests' whole needs fit the pool together (see _admit)
                raise RuntimeError(f"dp_rank {self.dp_rank}: {len(decoding)} decode slots cannot be found")
            victim = min(victims, key=lambda r: (len(r.output_ids), -len(r.input_ids)))
            self._retract(victim)
            step.retractions += 1
            decoding = [r for r in decoding if r is not victim]
        return decoding

    def _admit(self, step: ScheduledStep, req: Req, reserved: int) -> bool:
        """Admits `req` if its uncached prompt and estimated decode tokens fit beside the running
        requests' estimates and this step's `reserved` decode slots: locks its cached prefix
        (`req.slots`), takes a table row."""
        if req.retractions >= MAX_RETRACTIONS and not req.protected:
            # Protected requests are never retracted, so their whole needs must fit the pool together.
            if sum(r.max_len for r in self.running if r.protected) + req.max_len > self.kv.capacity:
                return False  # wait for them to finish, admitting nobody else
            req.protected = True
        req.prefill_len = len(req.input_ids) + len(req.output_ids)
        cached, node = ([], None) if req.kv_from_prefill else self.kv.match(req, recompute_last=self.nextn)
        others = sum(self._estimate(r) for r in self.running) + reserved
        if self.kv.available - others < req.prefill_len - len(cached) + self._estimate_decode(req):
            self.kv.unlock(node)
            return False
        req.table_row = self.free_table_rows.pop()
        self.kv.start(req, cached, node)
        if req.cached_tokens is None:
            req.cached_tokens = min(len(cached), len(req.input_ids))
            step.admitted.append((req.rid, req.cached_tokens))
        self.counters["cache_hit_tokens"] += len(cached)
        self.running.append(req)
        req.status = ReqStatus.AWAITING_KV if req.kv_from_prefill else ReqStatus.RUNNING
        return True

    def _add_chunk(self, step: ScheduledStep, req: Req, budget: int, reserved: int) -> int:
        """Adds up to `budget` of `req`'s prompt tokens, as many as memory allows beside the
        `reserved` decode slots of this step; returns the tokens added. The first chunk after its
        admission carries its cached prefix's slots into its table row, whichever step that is."""
        n = min(budget, req.prefill_len - req.kv_len, self.kv.available - reserved)
        if n <= 0:
            return 0
        start = req.kv_len
        prefix, slots, window_slots = self.kv.extend(req, n)
        done = start + n == req.prefill_len
        tokens = req.fill_ids[start : start + n]
        step.batch.reqs.append(
            BatchReq(req.table_row, start, tokens, slots, done, prefix, window_slots=window_slots)
        )
        step.reqs.append(req)
        step.prefilled.append(req)
        self.counters["prefilled_tokens"] += n
        return n

    def _retract(self, req: Req) -> None:
        self._release(req)
        self.running.remove(req)
        req.retractions += 1
        req.status = ReqStatus.WAITING
        self.waiting.appendleft(req)
        self.counters["retractions"] += 1
        logger.info(
            "dp_rank %d: retracted request %s (%d prompt + %d generated tokens, retraction %d); "
            "%d slots available",
            self.dp_rank,
            req.rid,
            len(req.input_ids),
            len(req.output_ids),
            req.retractions,
            self.kv.available,
        )

    def _release(self, req: Req) -> None:
        """Gives back what an admitted request holds; its KV stays in the prefix cache. A decode
        request still awaiting its KV leaves its slots in limbo: the prefill side may be writing."""
        if req.status is ReqStatus.AWAITING_KV:
            self.limbo.park(req.rid, req.slots, req.slots[req.window_lo :])
        else:
            self.kv.release(req)
        self.free_table_rows.append(req.table_row)
        req.table_row, req.slots, req.node, req.cached_len, req.dup_slots = 0, [], None, 0, []
        req.window_lo = 0
        req.prefix_pending = False
        req.proposed = []

    # --- after the forward -----------------------------------------------------------------------

    def process_samples(
        self,
        step: ScheduledStep,
        tokens: list[list[int]],
        logprobs: list[list[float]],
        top_logprobs: list[list[list[tuple[int, float]]]] | None = None,
        errors: list[str | None] | None = None,
    ) -> tuple[list[TokenOut], list[RequestOutput]]:
        """Appends each of `step`'s sampling requests' new tokens (one, or a verify step's accepted drafts and the
        next token), in order and none past a finish; frees the KV of rejected drafts; counts them for
        the penalties of requests still running; returns the tokens and the outputs of the requests that finished. Freshly prefilled prompts go
        into the prefix cache. A request the sampler could not go on with (`errors`) ends there, as
        an abort its caller sees as a 400 naming the cause. Under overlap scheduling the next step
        was scheduled meanwhile: a request that ended since (aborted, or its previous token ended it)
        drops its token; one retracted since keeps it (it prefills it when it resumes)."""
        new, finished = [], []
        top_logprobs = top_logprobs or [[[] for _ in t] for t in tokens]
        errors = errors or [None] * len(tokens)
        steps = zip(step.sampled, tokens, logprobs, top_logprobs, errors, strict=True)
        for req, toks, lps, tops, error in steps:
            req.in_flight -= 1
            if req.status is ReqStatus.FINISHED:
                continue
            reason, emitted = None, 0
            for tok, lp, top in zip(toks, lps, tops, strict=True):
                if not self._grammar_accepts(req, tok):  # its mask allowed it: never, unless a bug
                    reason = grammar_refused(tok, len(req.output_ids))
                    break
                new.append(TokenOut(req.rid, tok, lp, top))
                emitted += 1
                reason = self._take_token(req, tok, lp, top)
                if reason is not None:
                    break
            if reason is None and error is not None:
                reason = Abort(error, 400)
            self.counters["spec_accepted_tokens"] += max(0, min(emitted, len(toks) - 1))  # drafts among them
            self._free_rejected(req, emitted)
            held = (
                req.bootstrap is not None
                and self.disaggregation == "prefill"
                and req.status is ReqStatus.RUNNING
            )
            if reason is not None and held and not isinstance(reason, Abort):  # its KV goes to decode first
                self.running.remove(req)
                self.sending.hold(req.rid, req, reason)
                req.status = ReqStatus.SENDING
                continue
            if reason is not None:
                finished.append(self._finish(req, reason))
        self.kv.trim_windows(step.reqs)
        self.counters["generated_tokens"] += len(new)
        return new, finished

    def _free_rejected(self, req: Req, emitted: int) -> None:
        """Frees the KV of the drafts a verify step rejected: that of every token but the last is kept.
        A request that emitted nothing (a sampling error) keeps its last token's KV too: the prefix
        cache may hold it already."""
        if req.drafts:  # (nothing else is rejected: under overlap scheduling the next step's slot stays)
            keep = req.seq_len - 1 if emitted else req.seq_len
            self.kv.free_rejected(req, keep)
        req.drafts = []

    def _take_token(self, req: Req, tok: int, lp: float, top: list) -> FinishReason | None:
        """Appends a sampled token to `req`; returns the reason it ends there, if it does."""
        req.output_ids.append(tok)
        req.logprobs.append(lp)
        req.top_logprobs.append(top)
        reason = self._finish_reason(req, tok)
        if (
            reason is None
            and req.matcher is not None
            and req.grammar_after is None
            and req.matcher.terminated
        ):
            reason = Stop()  # complete, and no stop token to wait for
        return reason

    @staticmethod
    def _grammar_accepts(req: Req, tok: int) -> bool:
        """Moves `req`'s matcher past `tok` (the end of its reasoning only lifts the wait for it);
        False if the grammar refuses it, which then stays unaccepted."""
        if req.matcher is None:
            return True
        if req.grammar_after is not None:
            if tok == req.grammar_after:  # the reasoning ended: the grammar applies from here
                req.grammar_after = None
            return True
        return req.matcher.accept(tok)

    @staticmethod
    def set_drafts(drafting: list[Req], drafts: list[list[int]]) -> None:
        """NEXTN: the chains the MTP layer drafted for `drafting` (the requests of a `draft_batch`
        that draft, in order), proposed in their next step."""
        for req, chain in zip(drafting, drafts, strict=True):
            req.proposed = chain

    def stats(self) -> dict:
        """Load and cache figures of this DP group, for routing and /metrics."""
        c = self.counters
        return {
            "running": len(self.running) + len(self.sending),
            "queued": len(self.waiting),
            "kv_reserved": sum(self._estimate(r) for r in self.running),
            **self.kv.stats(),
            "new_token_ratio": self.new_token_ratio,
            "spec_accept_length": 1 + c["spec_accepted_tokens"] / max(c["spec_verify_steps"], 1),
            **c,
            **(self.grammars.counters if self.grammars is not None else dict.fromkeys(GRAMMAR_COUNTERS, 0)),
        }

    def _finish_reason(self, req: Req, tok: int) -> FinishReason | None:
        p = req.params
        if (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            return Stop(tok)
        if len(req.output_ids) >= p.max_new_tokens or req.seq_len >= self.context_len:
            return Length(len(req.output_ids))
        return None

    def _finish(self, req: Req, reason: FinishReason) -> RequestOutput:
        if req.status in (ReqStatus.RUNNING, ReqStatus.AWAITING_KV):
            self._release(req)
            self.running.remove(req)
        elif req.status is ReqStatus.SENDING:
            self.sending.pop(req.rid)
            self._release(req)
        elif req.status is ReqStatus.WAITING:
            self.waiting.remove(req)
        req.status = ReqStatus.FINISHED
        self.reqs.pop(req.rid, None)
        return self._output(req, reason)

    def _output(self, req: Req, reason: FinishReason) -> RequestOutput:
        return RequestOutput(
            req.rid,
            list(req.output_ids),
            reason,
            prompt_tokens=len(req.input_ids),
            cached_tokens=req.cached_tokens or 0,
            spec_verify_ct=req.spec_verify_ct,
            dp_rank=self.dp_rank,
            return_logprob=req.return_logprob,
            output_token_logprobs=list(req.logprobs) if req.return_logprob else [],
            output_top_logprobs=list(req.top_logprobs) if req.return_logprob else [],
        )
