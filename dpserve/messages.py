"""What crosses layers and processes, as types, each with its wire form in one place.

So far: why a request ended (`FinishReason`), built by the scheduler (and by the server's
detokenizer for stop strings) and sent out as SGLang's `meta_info.finish_reason` dict (`wire()`),
which the front end, the HTTP API and the offline Engine read."""

from __future__ import annotations

from dataclasses import dataclass


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
