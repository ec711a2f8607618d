"""What crosses layers and processes, as types, each with its wire form in one place.

Why a request ended (`FinishReason`), built by the scheduler (and by the server's detokenizer for
stop strings) and sent out as SGLang's `meta_info.finish_reason` dict (`wire()`); the messages
between the front end and its group leaders (pickled over ZeroMQ; each side dispatches on the type,
never on a string key); and prefill-decode disaggregation's destination (JSON between instances)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from dpserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class Stop:
    """It produced a stop token or text (`matched`: the token id, or the stop string the front end's
    detokenizer found; None when it ends complete with nothing to match, e.g. a finished grammar)."""

    matched: int | str | None = None

    def wire(self) -> dict:
        return {"type": "stop", "matched": self.matched}


@dataclass(frozen=True)
class Length:
    """It reached max_new_tokens or the context length with `length` output tokens."""

    length: int

    def wire(self) -> dict:
        return {"type": "length", "length": self.length}


@dataclass(frozen=True)
class Abort:
    """It failed: `message` says why, `status_code` the HTTP status its client gets (None: the
    front end's default); `write_failed` is said only by prefill-decode disaggregation (True: the
    prefill side could not write the KV)."""

    message: str
    status_code: int | None = None
    write_failed: bool | None = None

    def wire(self) -> dict:
        out: dict = {"type": "abort", "message": self.message}
        if self.status_code is not None:
            out["status_code"] = self.status_code
        if self.write_failed is not None:
            out["write_failed"] = self.write_failed
        return out


FinishReason = Stop | Length | Abort


# --- what a group leader reports after a step ------------------------------------------------------


class TokenOut(NamedTuple):
    """A token a request generated (for streaming), with its logprob and, if asked, the top
    alternatives (token, logprob)."""

    rid: str
    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(frozen=True)
class RequestOutput:
    """A request's end: everything it generated, and why it stopped."""

    rid: str
    output_ids: list[int]
    finish_reason: FinishReason
    prompt_tokens: int
    cached_tokens: int  # prompt tokens found in the prefix cache at first admission
    spec_verify_ct: int  # decode steps with speculative decoding on
    dp_rank: int
    return_logprob: bool = False
    output_token_logprobs: list[float] = field(default_factory=list)  # if return_logprob
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # if return_logprob
    drafts: list[int] = field(default_factory=list)  # prefill side with NEXTN: the MTP's first chain

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)

    def meta_info(self) -> dict:
        """SGLang's meta_info fields of the output (those of logprobs aside)."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "spec_verify_ct": self.spec_verify_ct,
            "finish_reason": self.finish_reason.wire(),
            "dp_rank": self.dp_rank,
        }


@dataclass(frozen=True)
class Rebalance:
    """One rebalance as the step log and /metrics report it."""

    step: int  # the forward step after which its last layer moved (counted from start-up)
    slots_moved: int  # slots whose expert changed, all ranks
    bytes_moved: int  # expert weights sent between ranks, all ranks (copies within a rank not counted)
    # The window's rows per rank over the mean rank's, averaged over the MoE layers, on the old and
    # the new placement (each expert's rows split evenly between its replicas).
    imbalance_before: float
    imbalance_after: float
    seconds: float  # this rank's time moving weights, over all the rebalance's step boundaries


@dataclass(frozen=True)
class StepReport:
    """What a group leader tells the front end after a step that changed anything: new tokens,
    requests admitted (with their cached prompt tokens) and ended, its MoE figures, and its load
    (for routing and /metrics)."""

    dp_rank: int
    tokens: list[TokenOut]
    cached: list[tuple[str, int]]  # (rid, prompt tokens found cached) of new admissions
    finished: list[RequestOutput]
    expert_imbalance: list[float]  # each MoE step's (for /metrics' histogram)
    rebalances: list[Rebalance]  # --enable-eplb: those that ended (for /metrics)
    stats: dict


# --- the front end to a group leader (besides each request's GenerateRequest) ----------------------


@dataclass(frozen=True)
class AbortRequest:
    """Stop `rid` and free its KV; its final output still comes: an abort saying `message`."""

    rid: str
    message: str = "aborted"


@dataclass(frozen=True)
class Wake:
    """Another group of this instance has work: step with it (DP attention joins every group)."""


@dataclass(frozen=True)
class FlushCache:
    """Evict every prefix-cache entry no running request holds."""


@dataclass(frozen=True)
class GetStepLog:
    """Send the steps logged since the last ask (`StepRecords`), then forget them."""


@dataclass(frozen=True)
class GetExpertLoad:
    """Send the rows per logical expert since the last ask (`ExpertLoad`), then zero them."""


@dataclass(frozen=True)
class Shutdown:
    """Leave the step loop (every rank, at the same step)."""


# --- a rank to the front end (besides each step's report) ----------------------------------------


@dataclass(frozen=True)
class Ready:
    """A rank started: its memory figures (`memory.RANK_FIGURES`) and its group's load."""

    rank: int
    dp_rank: int
    figures: dict[str, int]
    stats: dict


@dataclass(frozen=True)
class Beat:
    """A rank is alive; `step_age`: seconds its current step has run (None: between steps)."""

    rank: int
    step_age: float | None


@dataclass(frozen=True)
class WorkerError:
    """A rank failed and is exiting."""

    rank: int
    error: str
    traceback: str


@dataclass(frozen=True)
class StepRecords:
    """A group leader's step log (`GetStepLog`'s answer)."""

    dp_rank: int
    steps: list  # its StepRecords


@dataclass(frozen=True)
class ExpertLoad:
    """A group leader's expert load (`GetExpertLoad`'s answer)."""

    dp_rank: int
    load: object  # a [layers, experts] tensor of rows per logical expert (replicas' summed)


# --- prefill-decode disaggregation ---------------------------------------------------------------


@dataclass(frozen=True)
class Bootstrap:
    """Prefill-decode disaggregation: where a request's other half is, the prefill instance's
    bootstrap host and port, and the room both halves carry (the PD router's bootstrap_host,
    bootstrap_port and bootstrap_room)."""

    host: str
    port: int
    room: int


@dataclass(frozen=True)
class Destination:
    """Where a request's prompt KV goes: the decode group's `slots` (and `window_slots` of its last
    W - 1 positions, hybrid pool), its ranks' pool descriptors, and what both sides must agree on.
    Sent by the decode leader to the prefill instance as JSON (`wire`, `from_wire`)."""

    slots: list[int]
    ranks: list[dict]  # each decode rank's PoolDescriptor, as JSON
    kv_heads: int
    nextn: bool
    window_size: int  # the hybrid pool's window (0: none)
    window_slots: list[int]

    def wire(self) -> dict:
        return {
            "slots": self.slots,
            "ranks": self.ranks,
            "kv_heads": self.kv_heads,
            "nextn": self.nextn,
            "window": self.window_size,
            "window_slots": self.window_slots,
        }

    @classmethod
    def from_wire(cls, data: object) -> Destination:
        """Raises TypeError or KeyError for anything but a destination's JSON."""
        if not isinstance(data, dict):
            raise TypeError("no destination")
        return cls(
            [int(s) for s in data["slots"]],
            [dict(r) for r in data["ranks"]],
            int(data["kv_heads"]),
            bool(data["nextn"]),
            int(data["window"]),
            [int(s) for s in data["window_slots"]],
        )


@dataclass(frozen=True)
class KVDestination:
    """The prefill side's bootstrap endpoint paired `room`'s request `rid` with its destination:
    passed on to the request's group, which writes the KV once the first token is out."""

    rid: str
    room: int
    dest: Destination


@dataclass(frozen=True)
class RoomCancel:
    """The decode side gave `room`'s request up, or never asked for it: it is aborted."""

    rid: str
    room: int
    message: str = "the decode side gave the request up"


@dataclass(frozen=True)
class FirstToken:
    """The prefill side's answer: the KV is written and the request's first token (and with NEXTN
    the MTP layer's first drafts) is this. JSON between instances (`wire`, `answer_from_wire`)."""

    token: int
    logprob: float
    top: list[tuple[int, float]]
    drafts: list[int]

    def wire(self) -> dict:
        return {
            "token": self.token,
            "logprob": self.logprob,
            "top": [list(t) for t in self.top],
            "drafts": self.drafts,
        }


@dataclass(frozen=True)
class PrefillFailed:
    """The prefill side's answer (or the decode side's, at the deadline): no KV will come."""

    error: str
    write_failed: bool = False  # the prefill side could not write it

    def wire(self) -> dict:
        return {"error": self.error, "write_failed": self.write_failed}


PrefillAnswer = FirstToken | PrefillFailed


def answer_from_wire(data: dict) -> PrefillAnswer:
    """Raises TypeError, ValueError or KeyError for anything but an answer's JSON."""
    if "error" in data:
        return PrefillFailed(str(data["error"]), bool(data.get("write_failed")))
    top = [(int(t), float(lp)) for t, lp in data["top"]]
    return FirstToken(int(data["token"]), float(data["logprob"]), top, [int(d) for d in data["drafts"]])


@dataclass
class GenerateRequest:
    """What the front end sends to a DP group's scheduler."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    grammar_after: int | None = None  # the token (reasoning's end) after which its grammar applies
    bootstrap: Bootstrap | None = None  # prefill-decode disaggregation: its other half
