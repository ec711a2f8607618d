"""The handshake of prefill-decode disaggregation (docs/design.md, section 14): how a decode group
tells the prefill instance where a request's KV goes, and hears back when it is there.

The router sends the same request to both sides with a bootstrap room. The decode group's leader
reserves the request's slots and sends them, with its ranks' pool descriptors, to the prefill
instance's bootstrap endpoint (`DecodeLink.request`). The endpoint (`PrefillBootstrap`, a thread
of the prefill front end) pairs the room with the prefill request of the same room and hands the
destination to the front end, which passes it to the request's group; once the group has written
the KV, the front end answers the decode side with the first token (`PrefillBootstrap.done`).

Messages are JSON over ZMQ (ROUTER on the prefill side, one DEALER per prefill instance on each
decode leader): a peer's bytes are never unpickled.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass

import zmq

from dpserve.messages import (
    Bootstrap,
    Destination,
    KVDestination,
    PrefillAnswer,
    PrefillFailed,
    RoomCancel,
    answer_from_wire,
)

logger = logging.getLogger("dpserve")

POLL_MS = 10  # the endpoint thread's wait between checks of its outgoing replies and deadlines


def local_host() -> str:
    """This host's address as peers reach it (the interface of the default route; loopback without one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent: only a route is looked up
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


@dataclass
class _Room:
    rid: str | None = None  # the prefill request of this room, while it runs
    peer: bytes | None = None  # the decode leader that asked (its ROUTER identity)
    dest: Destination | None = None  # where to write
    reply: PrefillAnswer | None = None  # the answer, once the request ended before the decode side asked
    forwarded: bool = False
    deadline: float = 0.0


class PrefillBootstrap:
    """A prefill instance's bootstrap endpoint on `port`. Events for the front end (a destination
    for a request, a request whose decode side never asked) are pushed to `collector`, the address
    the workers report to, so the front end reads them with the workers' messages."""

    def __init__(self, port: int, timeout: float, collector: str):
        self.port, self.timeout = port, timeout
        self._rooms: dict[int, _Room] = {}
        self._lock = threading.Lock()
        self._replies: deque[tuple[bytes, int, PrefillAnswer]] = deque()  # (peer, room, answer)
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        try:
            self._router.bind(f"tcp://*:{port}")
        except zmq.ZMQError as e:
            self._ctx.destroy(linger=0)
            raise ValueError(f"the bootstrap port {port} cannot be bound ({e}): pick another") from None
        self._events = self._ctx.socket(zmq.PUSH)
        self._events.connect(collector)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="dpserve-bootstrap", daemon=True)
        self._thread.start()

    # --- the front end's side --------------------------------------------------------------------

    def check(self, room: int) -> None:
        with self._lock:
            if (r := self._rooms.get(room)) is not None and (r.rid is not None or r.reply is not None):
                raise ValueError(f"bootstrap_room {room} is already in use on this prefill instance")

    def add(self, room: int, rid: str) -> None:
        """A prefill request of `room` was submitted."""
        with self._lock:
            r = self._rooms.setdefault(room, _Room())
            r.rid, r.deadline = rid, time.monotonic() + self.timeout  # paired by the thread's next tick

    def done(self, room: int, reply: PrefillAnswer) -> None:
        """The request of `room` ended: `reply` is its first token, or its error."""
        with self._lock:
            r = self._rooms.get(room)
            if r is None:
                return
            if r.peer is not None:
                self._replies.append((r.peer, room, reply))
                del self._rooms[room]
            else:  # kept for a decode side that asks late
                r.rid, r.reply, r.deadline = None, reply, time.monotonic() + self.timeout

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._ctx.destroy(linger=0)

    # --- the thread ------------------------------------------------------------------------------

    def _serve(self) -> None:
        while not self._stop.is_set():
            if self._router.poll(POLL_MS):
                peer, payload = self._router.recv_multipart()
                try:
                    msg = zmq.utils.jsonapi.loads(payload)
                    room = int(msg["room"])
                    if not msg.get("cancel"):
                        msg["dest"] = Destination.from_wire(msg["dest"])
                except (ValueError, KeyError, TypeError):
                    logger.warning("bootstrap: a malformed message was dropped")
                    continue
                with self._lock:
                    self._on_peer(peer, room, msg)
            with self._lock:
                self._tick(time.monotonic())
                while self._replies:
                    peer, room, reply = self._replies.popleft()
                    self._router.send_multipart(
                        [peer, zmq.utils.jsonapi.dumps({"room": room, **reply.wire()})]
                    )

    def _on_peer(self, peer: bytes, room: int, msg: dict) -> None:
        r = self._rooms.get(room)
        if msg.get("cancel"):
            if r is not None and r.peer == peer and r.rid is not None:
                self._events.send_pyobj(RoomCancel(r.rid, room))
            elif r is not None and r.peer == peer:
                del self._rooms[room]
            return
        if r is not None and r.peer is not None:
            taken = f"bootstrap_room {room} is already taken by another decode request"
            self._replies.append((peer, room, PrefillFailed(taken)))
            return
        r = self._rooms.setdefault(room, _Room(deadline=time.monotonic() + self.timeout))
        r.peer, r.dest = peer, msg["dest"]
        if r.reply is not None:
            self._replies.append((peer, room, r.reply))
            del self._rooms[room]

    def _tick(self, now: float) -> None:
        """Hands each room with both halves to the front end, and ends those past their deadline.
        Only this thread uses the sockets."""
        for room, r in list(self._rooms.items()):
            if r.rid is not None and r.dest is not None and not r.forwarded:
                r.forwarded = True
                self._events.send_pyobj(KVDestination(r.rid, room, r.dest))
            if now < r.deadline or r.forwarded:
                continue
            if r.rid is not None:  # the decode side never asked: the request is aborted, done() follows
                r.deadline = float("inf")
                message = f"no decode instance asked for bootstrap_room {room} within {self.timeout:g} s"
                self._events.send_pyobj(RoomCancel(r.rid, room, message))
            elif r.peer is not None:
                message = f"no request with bootstrap_room {room} reached the prefill instance within {self.timeout:g} s"
                self._replies.append((r.peer, room, PrefillFailed(message)))
                del self._rooms[room]
            else:
                del self._rooms[room]


@dataclass
class _Wait:
    """A decode request whose KV the prefill side may still write."""

    rid: str
    key: tuple[str, int, int]  # bootstrap host, port, room
    deadline: float
    cancelled: bool = False  # asked not to write; answered: its error or first token was taken


class DecodeLink:
    """A decode group leader's side: one DEALER per prefill instance; each request's destination
    sent, its answer or its deadline awaited. Past the deadline the request fails, the prefill
    side is asked to cancel and the slots stay reserved for one more timeout (or until it answers):
    a slow prefill instance may still be writing."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._ctx = zmq.Context()
        self._dealers: dict[tuple[str, int], zmq.Socket] = {}
        self._waits: dict[tuple[str, int, int], _Wait] = {}
        self._by_rid: dict[str, _Wait] = {}

    @property
    def busy(self) -> bool:
        """Whether an answer is awaited."""
        return bool(self._waits)

    def request(self, rid: str, boot: Bootstrap, dest: Destination) -> None:
        self._send(boot.host, boot.port, {"room": boot.room, "dest": dest.wire()})
        wait = _Wait(rid, (boot.host, boot.port, boot.room), time.monotonic() + self.timeout)
        self._waits[wait.key] = self._by_rid[rid] = wait

    def waiting(self, rid: str) -> bool:
        """Whether the prefill side may still write into `rid`'s slots."""
        return rid in self._by_rid

    def cancel(self, rid: str) -> None:
        """Asks the prefill side not to write (the request ended here)."""
        wait = self._by_rid[rid]
        if not wait.cancelled:
            self._cancel(wait)

    def poll(self) -> list[tuple[str, PrefillAnswer]]:
        """(rid, answer) of the requests answered, or past their deadline (PrefillFailed)."""
        out = []
        for (host, port), sock in self._dealers.items():
            while sock.poll(0):
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    msg = zmq.utils.jsonapi.loads(sock.recv())
                    wait = self._waits.get((host, port, int(msg["room"])))
                    answer = answer_from_wire(msg)
                    if wait is not None:
                        self._done(wait)
                        if not wait.cancelled:
                            out.append((wait.rid, answer))
        now = time.monotonic()
        for wait in list(self._waits.values()):
            if now < wait.deadline:
                continue
            if wait.cancelled:  # the prefill side had a second timeout to stop
                self._done(wait)
                continue
            host, port, room = wait.key
            message = (
                f"the prefill instance {host}:{port} did not deliver the KV of bootstrap_room {room} "
                f"within {self.timeout:g} s"
            )
            out.append((wait.rid, PrefillFailed(message)))
            self._cancel(wait)
        return out

    def close(self) -> None:
        self._ctx.destroy(linger=0)

    def _cancel(self, wait: _Wait) -> None:
        self._send(wait.key[0], wait.key[1], {"room": wait.key[2], "cancel": True})
        wait.cancelled, wait.deadline = True, time.monotonic() + self.timeout

    def _done(self, wait: _Wait) -> None:
        del self._waits[wait.key], self._by_rid[wait.rid]

    def _send(self, host: str, port: int, msg: dict) -> None:
        sock = self._dealers.get((host, port))
        if sock is None:
            sock = self._dealers[(host, port)] = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{host}:{port}")
        with contextlib.suppress(zmq.Again):  # a prefill instance that is gone: the deadline answers
            sock.send(zmq.utils.jsonapi.dumps(msg), flags=zmq.NOBLOCK)
