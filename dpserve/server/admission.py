"""Who and what gets in, before FastAPI sees a request: the API key (--api-key), the body size
limit (--max-request-bytes), JSON bodies only (415), load shedding (--max-queued-requests: requests
waiting beyond what runs) and draining on a graceful stop
(--graceful-shutdown-timeout). A plain ASGI middleware, so a refused body is never read whole."""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Callable
from dataclasses import dataclass, field

# Endpoints that queue work on the workers: the ones counted, shed and drained.
GENERATION_PATHS = frozenset({"/generate", "/v1/completions", "/v1/chat/completions"})
RETRY_AFTER_S = 1  # what a shed request is told to wait
DEFAULT_MAX_REQUEST_BYTES = 32 << 20  # far above a context-length prompt sent as token ids
DRAIN_BYTES = 1 << 20  # of a body over the limit: read and dropped before the 413
ERROR_TYPES = {
    401: "authentication_error",
    404: "not_found_error",
    422: "grammar_error",
    503: "service_unavailable",
}
JSON_TYPES = (b"application/json",)  # and any application/*+json


def error_body(status: int, message: str) -> dict:
    """The one error shape of every path (OpenAI's): {"error": {"message", "type", "code"}}."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "internal_error")
    return {"error": {"message": message, "type": kind, "code": status}}


def _is_json(content_type: bytes) -> bool:
    media = content_type.split(b";", 1)[0].strip().lower()
    return media in JSON_TYPES or (media.startswith(b"application/") and media.endswith(b"+json"))


@dataclass
class Admission:
    """The limits and what they did: requests in flight, and the ones refused by reason."""

    api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_queued_requests: int | None = None  # waiting requests; None: unbounded
    running_capacity: int = 0  # requests the instance runs at once: --max-running-requests x groups
    reported_waiting: Callable[[], int] = lambda: 0  # what the groups' leaders last reported waiting
    in_flight: int = 0  # generation requests admitted and not answered yet (waiting or running)
    draining: bool = False  # a graceful stop began: nothing new is admitted
    rejected: dict[str, int] = field(
        default_factory=lambda: {"overloaded": 0, "draining": 0, "unauthorized": 0, "too_large": 0}
    )
    _idle: asyncio.Event = field(default_factory=asyncio.Event, init=False, repr=False)

    def __post_init__(self) -> None:
        self._idle.set()

    @property
    def waiting(self) -> int:
        """Requests admitted and not running yet, as SGLang's --max-queued-requests counts them: those
        in flight beyond what the groups run at once, or what their leaders last reported waiting
        (a group short of KV runs fewer), whichever is more. Counted here, as requests arrive, so
        that requests arriving together cannot all pass before the engine hears of the first."""
        return max(self.in_flight - self.running_capacity, self.reported_waiting(), 0)

    def figures(self) -> dict:
        return {
            "requests_in_flight": self.in_flight,
            "requests_waiting": self.waiting,
            "max_queued_requests": self.max_queued_requests,
            "max_request_bytes": self.max_request_bytes,
            "draining": self.draining,
            "rejected_requests": dict(self.rejected),
        }

    async def drained(self, timeout: float) -> bool:
        """Waits up to `timeout` seconds until no generation request is in flight; True if none is."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def middleware(self, app):
        async def admit(scope, receive, send) -> None:
            if scope["type"] != "http":
                return await app(scope, receive, send)
            path, headers = scope["path"], dict(scope["headers"])
            if path == "/health":
                if self.draining:
                    return await _error(send, 503, "the server is shutting down")
                return await app(scope, receive, send)
            if self.api_key is not None and not self._authorized(headers.get(b"authorization", b"")):
                self.rejected["unauthorized"] += 1
                return await _error(
                    send,
                    401,
                    "invalid or missing API key (Authorization: Bearer KEY)",
                    {"www-authenticate": "Bearer"},
                )
            if scope["method"] in ("POST", "PUT", "PATCH"):
                body = await self._read_body(headers, receive)
                if body is None:
                    self.rejected["too_large"] += 1
                    return await _error(
                        send,
                        413,
                        f"the request body is larger than --max-request-bytes {self.max_request_bytes}",
                    )
                receive = _replay(body, receive)
            if path not in GENERATION_PATHS or scope["method"] != "POST":
                return await app(scope, receive, send)
            content_type = headers.get(b"content-type")
            if content_type is not None and not _is_json(content_type):
                return await _error(
                    send,
                    415,
                    f"the body must be JSON (Content-Type: application/json), not {content_type.decode('latin-1')!r}",
                )
            refusal = self._refusal()
            if refusal is not None:
                return await _error(send, 503, refusal, {"retry-after": str(RETRY_AFTER_S)})
            self.in_flight += 1
            self._idle.clear()
            try:
                await app(scope, receive, send)
            finally:
                self.in_flight -= 1
                if not self.in_flight:
                    self._idle.set()

        return admit

    def _authorized(self, header: bytes) -> bool:
        return hmac.compare_digest(header, f"Bearer {self.api_key}".encode())

    def _refusal(self) -> str | None:
        if self.draining:
            self.rejected["draining"] += 1
            return "the server is shutting down: it admits no new requests"
        if self.max_queued_requests is not None and self.waiting >= self.max_queued_requests:
            self.rejected["overloaded"] += 1
            return (
                f"the server is overloaded: {self.waiting} requests waiting (--max-queued-requests "
                f"{self.max_queued_requests}) beside {self.in_flight - self.waiting} running; retry later"
            )
        return None

    async def _read_body(self, headers: dict, receive) -> bytes | None:
        """The whole body, or None once it is known to exceed the limit (from Content-Length, or
        counted as it arrives). A body over the limit is never kept; up to DRAIN_BYTES of it are
        read and dropped so that the client, still sending, can read the 413 (closing a socket
        with unread data resets the connection); a larger one is cut off."""
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_request_bytes + DRAIN_BYTES:
            return None
        body, size, more = bytearray(), 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left: the app finds out
                break
            chunk, more = message.get("body", b""), message.get("more_body", False)
            size += len(chunk)
            if size > self.max_request_bytes + DRAIN_BYTES:
                return None
            if size <= self.max_request_bytes:
                body += chunk
        return bytes(body) if size <= self.max_request_bytes else None


def _replay(body: bytes, receive):
    """A receive that first hands the app the body read already, then the connection's events."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _error(send, status: int, message: str, headers: dict[str, str] | None = None) -> None:
    """An OpenAI-style JSON error, as the app's own errors (server/http.py)."""
    body = json.dumps(error_body(status, message)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    if status == 413:
        raw.append((b"connection", b"close"))  # the rest of the body is not read
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
