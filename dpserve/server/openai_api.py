"""/v1/completions and /v1/chat/completions: OpenAI's request and response shapes."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from functools import partial

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from dpserve.server.protocol import ChatCompletionRequest, CompletionRequest, _OpenAIRequest
from dpserve.server.reasoning import ReasoningSplitter, split_reasoning
from dpserve.server.streams import abort_event, aborted_error, collect, merge, sse
from dpserve.server.tokenizer_manager import Chunk, RequestError, Submission, TokenizerManager
from dpserve.server.tools import ToolCallStream

FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


def finish_reason(chunk: Chunk) -> str | None:
    return None if chunk.finish_reason is None else FINISH_REASONS[chunk.finish_reason["type"]]


class OpenAIServing:
    def __init__(self, tm: TokenizerManager, model_name: str):
        self.tm = tm
        self.model_name = model_name

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise RequestError(
                f"The model `{name}` does not exist; this server serves `{self.model_name}`", 404
            )

    def models(self) -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "dpserve",
                    "max_model_len": self.tm.model_cfg.context_len,
                }
            ],
        }

    async def _submissions(
        self,
        req: _OpenAIRequest,
        prompts: list[list[int]],
        max_tokens: int | None,
        logprobs: bool,
        grammar_after: int | None = None,
    ):
        subs = []
        boots = iter(self.tm.bootstraps(req, len(prompts) * req.n))
        for ids in prompts:
            max_new = max_tokens if max_tokens is not None else self.tm.default_max_tokens(len(ids))
            if req.min_tokens > max_new:
                raise RequestError(
                    f"min_tokens={req.min_tokens} is more than the {max_new} new tokens allowed"
                )
            for j in range(req.n):
                subs.append(
                    Submission(
                        ids,
                        req.sampling_params(max_new, j),
                        req.stop_strings,
                        logprobs,
                        req.data_parallel_rank,
                        grammar_after,
                        next(boots),
                    )
                )
        for sub in subs:
            await self.tm.check(sub)
        return subs

    async def completions(self, req: CompletionRequest, request: Request):
        self.check_model(req.model)
        prompt = req.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        ids = [p if isinstance(p, list) else await asyncio.to_thread(self.tm.tokenize, p) for p in prompt]
        subs = await self._submissions(req, ids, req.max_new_tokens, req.logprobs is not None)
        # echo: each choice's text starts with its prompt (as given, or decoded from token ids).
        echo = None
        if req.echo:
            echo = [
                p if isinstance(p, str) else self.tm.tokenizer.decode(p) for p in prompt for _ in range(req.n)
            ]
        choice = partial(self._completion_choice, echo=echo, top=req.top_logprobs_num > 0)
        return await self._respond(req, request, subs, "text_completion", choice)

    async def chat(self, req: ChatCompletionRequest, request: Request):
        self.check_model(req.model)
        messages = [m.as_template_input() for m in req.messages]
        mode, tool_parser = req.tool_mode, self.tm.cfg.tool_call_parser
        if mode == "auto" and tool_parser is None:
            raise RequestError(
                'tools with tool_choice "auto" need the server started with --tool-call-parser (the model '
                'family\'s format of calls); "required" or a named function work without it'
            )
        template_kwargs = dict(req.chat_template_kwargs or {})
        if mode != "none":  # the template tells the model about its tools
            template_kwargs["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
        try:
            ids = await asyncio.to_thread(
                self.tm.chat_prompt, messages, req.continue_final_message, **template_kwargs
            )
        except TypeError as e:  # a chat_template_kwargs key the template function refuses
            raise RequestError(f"chat_template_kwargs: {e}") from None
        reasoning_parser = self.tm.cfg.reasoning_parser
        thinking = reasoning_parser is not None and not (
            reasoning_parser == "qwen3" and (req.chat_template_kwargs or {}).get("enable_thinking") is False
        )
        # A grammar applies once the reasoning ends, as SGLang's reasoner grammars do.
        grammar = thinking and any(v is not None for v in req.grammar.values())
        after = self.tm.think_end_id() if grammar else None
        subs = await self._submissions(req, [ids], req.max_new_tokens, req.logprobs, after)
        splitters = None
        if thinking and req.separate_reasoning:
            splitters = [ReasoningSplitter(reasoning_parser, req.stream_reasoning) for _ in subs]
        calls = None if mode == "none" else [ToolCallStream(tool_parser, mode) for _ in subs]
        choice = partial(self._chat_choice, splitters=splitters, calls=calls)
        return await self._respond(req, request, subs, "chat.completion", choice)

    async def _respond(
        self, req: _OpenAIRequest, request: Request, subs: list[Submission], kind: str, choice
    ):
        rid = f"{'chatcmpl' if kind.startswith('chat') else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        streams = [self.tm.generate(s) for s in subs]
        head = {"id": rid, "created": created, "model": self.model_name}
        # Each prompt's tokens count once, whatever n is.
        prompt_tokens = sum(len(s.input_ids) for s in subs[:: req.n])
        if req.stream:
            return StreamingResponse(
                self._stream(req, subs, streams, head, kind, choice, prompt_tokens),
                media_type="text/event-stream",
            )
        results = await collect(request, streams)
        choices = [choice(i, chunks, subs[i].return_logprob, final=True) for i, chunks in enumerate(results)]
        aborted = [chunks[-1].finish_reason for chunks in results if finish_reason(chunks[-1]) == "abort"]
        if aborted:
            raise aborted_error(aborted[0])
        usage = _usage(prompt_tokens, [chunks[-1] for chunks in results], req.n)
        return JSONResponse({**head, "object": kind, "choices": choices, "usage": usage})

    async def _stream(self, req, subs, streams, head, kind, choice, prompt_tokens) -> AsyncIterator[str]:
        last: list[Chunk | None] = [None] * len(streams)
        first = [True] * len(streams)
        obj = "chat.completion.chunk" if kind.startswith("chat") else kind
        async for i, chunk in merge(streams):
            last[i] = chunk
            if not (chunk.text or chunk.token_ids or chunk.finish_reason or first[i]):
                continue
            body = choice(i, [chunk], subs[i].return_logprob, final=False, first=first[i])
            first[i] = False
            yield sse({**head, "object": obj, "choices": [body], "usage": None})
        error = abort_event(last)
        if error is not None:  # headers went out with 200: the client learns why here
            yield error
        elif req.include_usage:
            yield sse({**head, "object": obj, "choices": [], "usage": _usage(prompt_tokens, last, req.n)})
        yield sse("[DONE]")

    def _token_logprobs(self, chunks: list[Chunk]) -> list[tuple[str, float, list[tuple[str, float]]]]:
        """Each new token's text and logprob, with its alternatives' (text, logprob)."""
        text = self.tm.tokenizer.decode
        return [
            (text([t]), lp, [(text([a]), alp) for a, alp in top])
            for c in chunks
            for t, lp, top in zip(c.token_ids, c.logprobs, c.top_logprobs, strict=True)
        ]

    def _completion_choice(
        self,
        index: int,
        chunks: list[Chunk],
        with_logprobs: bool,
        final: bool,
        first: bool = False,
        echo: list[str] | None = None,
        top: bool = False,
    ) -> dict:
        logprobs = None
        if with_logprobs:
            entries = self._token_logprobs(chunks)
            logprobs = {
                "tokens": [t for t, _, _ in entries],
                "token_logprobs": [lp for _, lp, _ in entries],
                # Token texts may repeat (pieces of one character): each keeps its likeliest.
                "top_logprobs": [dict(reversed(alts)) for _, _, alts in entries] if top else None,
                "text_offset": None,
            }
        prefix = echo[index] if echo and (final or first) else ""
        return {
            "index": index,
            "text": prefix + "".join(c.text for c in chunks),
            "logprobs": logprobs,
            "finish_reason": finish_reason(chunks[-1]),
        }

    def _chat_logprobs(self, chunks: list[Chunk]) -> dict:
        """A chat choice's logprobs: each token's, its bytes and its top alternatives'."""
        return {
            "content": [
                {
                    "token": t,
                    "logprob": lp,
                    "bytes": list(t.encode()),
                    "top_logprobs": [
                        {"token": a, "logprob": alp, "bytes": list(a.encode())} for a, alp in top
                    ],
                }
                for t, lp, top in self._token_logprobs(chunks)
            ]
        }

    def _chat_choice(
        self,
        index: int,
        chunks: list[Chunk],
        with_logprobs: bool,
        final: bool,
        first: bool = False,
        splitters: list[ReasoningSplitter] | None = None,
        calls: list[ToolCallStream] | None = None,
    ) -> dict:
        """A chat choice: the whole message (`final`) or a stream delta; with `splitters` (a
        reasoning parser), each choice's reasoning apart from its content; with `calls` (tools),
        its tool calls (`ToolCallStream`)."""
        logprobs = self._chat_logprobs(chunks) if with_logprobs else None
        text = "".join(c.text for c in chunks)
        out = {"index": index, "logprobs": logprobs, "finish_reason": finish_reason(chunks[-1])}
        reasoning, tool_calls = None, []
        done = chunks[-1].finish_reason is not None
        if splitters is not None:
            if final:  # the whole reply, whatever was streamed
                reasoning, text = split_reasoning(text, splitters[index].parser)
            else:
                reasoning, text = splitters[index].feed(text, final=done)
        stream = None
        if calls is not None:
            stream = calls[index] if not final else ToolCallStream(calls[index].parser, calls[index].choice)
            text, tool_calls = stream.feed(text, final=final or done)
        if stream is not None and stream.called and out["finish_reason"] == "stop":
            out["finish_reason"] = "tool_calls"
        if final:
            out["message"] = {"role": "assistant", "content": text or (None if tool_calls else text)}
            if splitters is not None:
                out["message"]["reasoning_content"] = reasoning or None
            if tool_calls:
                out["message"]["tool_calls"] = [
                    {k: v for k, v in c.items() if k != "index"} for c in tool_calls
                ]
        else:
            delta = {"role": "assistant"} if first else {}
            if reasoning:
                delta["reasoning_content"] = reasoning
            if text or not (reasoning or tool_calls):
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            out["delta"] = delta
        return out


def _usage(prompt_tokens: int, last_chunks: list[Chunk | None], n: int) -> dict:
    """OpenAI's usage: each prompt counts once whatever n is, and so do its cached tokens."""
    completion = sum(c.completion_tokens for c in last_chunks if c is not None)
    cached = sum(c.cached_tokens for c in last_chunks[::n] if c is not None)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
