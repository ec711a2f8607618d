"""Running several sequences of one HTTP request: merged streams, collection, SSE framing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi import Request

from dpserve.server.admission import error_body
from dpserve.server.tokenizer_manager import Chunk, RequestError

DISCONNECT_POLL_S = 0.5


class ClientDisconnected(Exception):
    pass


async def merge(streams: list[AsyncIterator[Chunk]]) -> AsyncIterator[tuple[int, Chunk]]:
    """Chunks of all streams as they come, tagged with the stream's index. Closing this generator
    closes (and so aborts) the streams still running."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[Chunk]) -> None:
        try:
            async for chunk in stream:
                await queue.put((i, chunk))
            await queue.put((i, done))
        except Exception as e:  # handed to the consumer; cancellation propagates into the stream
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(request: Request, streams: list[AsyncIterator[Chunk]]) -> list[list[Chunk]]:
    """All chunks of every stream; aborts them all if the client disconnects meanwhile."""
    out: list[list[Chunk]] = [[] for _ in streams]

    async def run() -> None:
        async for i, chunk in merge(streams):
            out[i].append(chunk)

    task = asyncio.create_task(run())
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            task.result()
            return out
        if await request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise ClientDisconnected


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def aborted_error(reason: dict) -> RequestError:
    """The error of a request that ended in an abort: 400 when its own parameters left nothing to
    sample, 503 when the server stopped it (a failure, a hung rank, a shutdown)."""
    return RequestError(
        f"the request was aborted: {reason.get('message', 'aborted')}", reason.get("status_code", 503)
    )


def abort_event(last: list[Chunk | None]) -> str | None:
    """For a stream whose sequences ended, the SSE error event (vLLM's and SGLang's form, which the
    openai client raises as an APIError) when one of them was aborted; None when none was."""
    reason = next(
        (c.finish_reason for c in last if c and c.finish_reason and c.finish_reason["type"] == "abort"),
        None,
    )
    if reason is None:
        return None
    error = aborted_error(reason)
    return sse(error_body(error.status, str(error)))
