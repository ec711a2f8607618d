"""The FastAPI app: native /generate, the OpenAI API, health, server info and Prometheus metrics.

Every caller mistake is a JSON error {"error": {"message", "type", "code"}} with a 4xx status.
"""

from __future__ import annotations

import asyncio
import logging
import os
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dpserve.sampling_params import INT64_MAX, INT64_MIN, SamplingParams, check_stop_strings
from dpserve.server.admission import Admission, error_body
from dpserve.server.metrics import CONTENT_TYPE
from dpserve.server.openai_api import OpenAIServing
from dpserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    GenerateRequestBody,
)
from dpserve.server.streams import ClientDisconnected, abort_event, aborted_error, collect, merge, sse
from dpserve.server.tokenizer_manager import Chunk, RequestError, Submission, TokenizerManager

logger = logging.getLogger("dpserve.server")

# What each error status means, for the OpenAPI document (the body: protocol.ErrorResponse).
ERRORS = {
    400: "An invalid request: the message names the field and its bound",
    401: "A missing or wrong API key (--api-key)",
    404: "An unknown model",
    413: "A body larger than --max-request-bytes",
    415: "A body that is not JSON (Content-Type)",
    503: "Overloaded (--max-queued-requests), shutting down, or stopped by a worker failure",
}
GENERATION_ERRORS = (400, 401, 404, 413, 415, 503)
STREAMED = {200: {"content": {"text/event-stream": {}}}}  # server-sent events, each a JSON body
PLAIN_TEXT = {"content": {"text/plain": {"schema": {"type": "string"}}}}


def errors(*statuses: int) -> dict:
    return {s: {"model": ErrorResponse, "description": ERRORS[s]} for s in statuses}


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status, headers=headers)


# Names pydantic gives the members of a union in an error's location: not fields, left out.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _is_field(part: object) -> bool:
    return isinstance(part, int) or (
        part != "body" and part not in _TYPE_TAGS and "[" not in part and "-" not in part
    )


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err["loc"] if _is_field(x))
        if err["type"] == "model_attributes_type" and not loc:
            parts.append("the body must be a JSON object (and sent with Content-Type: application/json)")
        elif err["type"] == "json_invalid":
            parts.append(f"the body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}")
        else:
            parts.append(f"{loc}: {err['msg']}" if loc else err["msg"])
    return "; ".join(dict.fromkeys(parts))  # a union's members often fail alike


def create_app(tm: TokenizerManager, model_name: str, admission: Admission | None = None):
    """The FastAPI app behind `admission`'s checks (API key, body size, shedding, draining)."""
    admission = admission or Admission()
    admission.running_capacity = tm.cfg.running_per_group * tm.cfg.dp_size
    admission.reported_waiting = lambda: sum(s.get("queued", 0) for s in tm.front.stats)
    tm.metrics_registry.watch_admission(admission.figures)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        tm.start()
        yield
        tm.abort_all("the server is shutting down")

    app = FastAPI(title="dpserve", lifespan=lifespan, responses=errors(401))
    app.openapi = lambda: _openapi(app, model_name, tm.model_cfg.vocab_size)
    _add_error_handlers(app)
    _add_server_routes(app, tm, model_name, admission)
    _add_cache_and_metrics_routes(app, tm)
    _add_generation_routes(app, tm, OpenAIServing(tm, model_name))
    return admission.middleware(app)


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as the OpenAI-style JSON body, with its status."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return error_response(400, _validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        # FastAPI's own: an unknown path or method, and a body it could not parse as JSON at all
        # (not UTF-8, nested past the parser's recursion limit).
        message = str(exc.detail)
        if exc.status_code == 400:
            message = "the body could not be parsed as JSON (it is not UTF-8, or is nested too deeply)"
        return error_response(exc.status_code, message, exc.headers)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError):
        return error_response(exc.status, str(exc))

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected):
        return error_response(499, "the client disconnected")


def _add_server_routes(app: FastAPI, tm: TokenizerManager, model_name: str, admission: Admission) -> None:
    """SGLang's server endpoints: health, server and model info, load."""

    @app.get("/health", response_class=PlainTextResponse, responses={200: PLAIN_TEXT, **errors(503)})
    async def health():
        if tm.failure is not None:
            return error_response(503, f"a worker failed: {tm.failure}")
        if (problem := tm.front.health()) is not None:
            return error_response(503, problem)
        return PlainTextResponse("ok")

    @app.get("/get_server_info")
    @app.get("/server_info")  # SGLang's newer name, which its router asks first
    async def get_server_info():
        pids = {p.name.removeprefix("dpserve-rank"): p.pid for p in tm.front.workers.procs}
        return {
            **tm.info,
            "model_path": tm.cfg.model_path,
            "served_model_name": model_name,
            "pid": os.getpid(),  # the HTTP server's
            "worker_pids": pids,  # this node's ranks
            **tm.front.metrics(),
            **admission.figures(),
        }

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def get_model_info():
        return {
            "model_path": tm.cfg.model_path,
            "tokenizer_path": tm.cfg.model_path,
            "served_model_name": model_name,
            "is_generation": True,
            "model_type": tm.model_cfg.hf.model_type,
            "architectures": [tm.model_cfg.arch],
            "max_context_length": tm.model_cfg.context_len,
        }

    @app.get("/get_load")
    async def get_load():
        """SGLang's load report, per DP group (sglang-router sums num_tokens over them)."""
        return [
            {
                "dp_rank": g["dp_rank"],
                "num_reqs": g["inflight_requests"],
                "num_waiting_reqs": g["queued"],
                "num_tokens": g["outstanding_tokens"],  # prompt tokens to prefill + decode budgets left
            }
            for g in tm.front.metrics()["dp_ranks"]
        ]


def _add_cache_and_metrics_routes(app: FastAPI, tm: TokenizerManager) -> None:
    """SGLang's operations: flushing the prefix cache, dumping the expert load; /metrics."""

    @app.post("/flush_cache", response_class=PlainTextResponse, responses={200: PLAIN_TEXT, **errors(413)})
    async def flush_cache():
        tm.front.flush_cache()
        return PlainTextResponse("Cache flushed: every prefix-cache entry no running request holds.")

    @app.post("/dump_expert_load", responses=errors(400, 503))
    async def dump_expert_load():
        """Rows routed to each expert of each MoE layer since the last dump (then cleared): saved
        to a file, what --init-expert-location and python -m dpserve.eplb read."""
        return {"rows_per_expert": await tm.expert_load()}

    @app.get("/metrics", response_class=PlainTextResponse, responses={200: PLAIN_TEXT})
    async def metrics():
        return Response(tm.metrics_registry.render(), media_type=CONTENT_TYPE)


def _add_generation_routes(app: FastAPI, tm: TokenizerManager, openai: OpenAIServing) -> None:
    """The OpenAI API and SGLang's native /generate."""

    @app.get("/v1/models")
    async def models():
        return openai.models()

    @app.post("/v1/completions", responses={**STREAMED, **errors(*GENERATION_ERRORS)})
    async def completions(body: CompletionRequest, request: Request):
        return await openai.completions(body, request)

    @app.post("/v1/chat/completions", responses={**STREAMED, **errors(*GENERATION_ERRORS)})
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await openai.chat(body, request)

    @app.post("/generate", responses={**STREAMED, **errors(*GENERATION_ERRORS)})
    async def generate(body: GenerateRequestBody, request: Request):
        if body.model is not None:
            openai.check_model(body.model)
        return await native_generate(tm, body, request)


def _openapi(app: FastAPI, model_name: str, vocab_size: int) -> dict:
    """FastAPI's document, made to say what the server does: no 422 (validation errors are 400s),
    every error a JSON ErrorResponse (also on the plain-text endpoints), integer bounds as integers
    (FastAPI writes them as floats, and int64's maximum as 2^63), token ids within the served
    model's vocabulary, and `model` its name."""
    if app.openapi_schema is None:
        schema = _integer_bounds(FastAPI.openapi(app), vocab_size)
        models = schema["components"]["schemas"]
        served = {"type": "string", "enum": [model_name], "title": "Model"}
        for name in ("CompletionRequest", "ChatCompletionRequest"):
            models[name]["properties"]["model"] = served
        models["GenerateRequestBody"]["properties"]["model"] = {"anyOf": [served, {"type": "null"}]}
        error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
        for operations in schema["paths"].values():
            for operation in operations.values():
                operation["responses"].pop("422", None)
                for status, response in operation["responses"].items():
                    if int(status) >= 400:
                        response["content"] = error
        for name in ("HTTPValidationError", "ValidationError"):
            schema["components"]["schemas"].pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema


def _integer_bounds(node, vocab_size: int):
    if isinstance(node, dict):
        out = {k: _integer_bounds(v, vocab_size) for k, v in node.items()}
        if out.get("type") == "integer":
            for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
                if isinstance(out.get(key), float):
                    out[key] = min(max(int(out[key]), INT64_MIN), INT64_MAX)
            if out.pop("x-token-id", False):
                out["maximum"] = vocab_size - 1
        return out
    if isinstance(node, list):
        return [_integer_bounds(v, vocab_size) for v in node]
    return node


def _native_params(d: dict | None, body: GenerateRequestBody) -> tuple[SamplingParams, list[str]]:
    d = dict(d or {})
    if body.return_logprob and body.top_logprobs_num:
        d["top_logprobs_num"] = body.top_logprobs_num
    try:
        stop = check_stop_strings(d.pop("stop", None) or [])
        return SamplingParams.from_dict(d), stop
    except (TypeError, ValueError) as e:
        raise RequestError(f"sampling_params: {e}") from None


async def native_generate(tm: TokenizerManager, body: GenerateRequestBody, request: Request):
    """SGLang's /generate: one dict per prompt, {"text", "output_ids", "meta_info"}."""
    single = isinstance(body.text, str) or (bool(body.input_ids) and isinstance(body.input_ids[0], int))
    if body.text is not None:
        texts = [body.text] if single else body.text
        prompts = [await asyncio.to_thread(tm.tokenize, t) for t in texts]
    else:
        prompts = [body.input_ids] if single else body.input_ids
    if isinstance(body.sampling_params, list) and len(body.sampling_params) != len(prompts):
        raise RequestError(f"{len(body.sampling_params)} sampling_params for {len(prompts)} prompts")
    per_prompt = (
        body.sampling_params
        if isinstance(body.sampling_params, list)
        else [body.sampling_params] * len(prompts)
    )
    subs = []
    boots = tm.bootstraps(body, len(prompts))
    for ids, raw, boot in zip(prompts, per_prompt, boots, strict=True):
        params, stop = _native_params(raw, body)
        subs.append(
            Submission(list(ids), params, stop, body.return_logprob, body.data_parallel_rank, bootstrap=boot)
        )
    for sub in subs:
        await tm.check(sub)
    streams = [tm.generate(s) for s in subs]
    if body.stream:
        if not single:
            raise RequestError("stream=true takes a single prompt")
        return StreamingResponse(_native_stream(tm, streams[0], body), media_type="text/event-stream")
    results = await collect(request, streams)
    outs = [_native_output(tm, chunks, body) for chunks in results]
    aborted = [o for o in outs if o["meta_info"]["finish_reason"]["type"] == "abort"]
    if aborted:
        raise aborted_error(aborted[0]["meta_info"]["finish_reason"])
    return outs[0] if single else outs


def _native_output(tm: TokenizerManager, chunks: list[Chunk], body: GenerateRequestBody) -> dict:
    last = chunks[-1]
    meta = {
        "prompt_tokens": last.prompt_tokens,
        "completion_tokens": last.completion_tokens,
        "cached_tokens": last.cached_tokens,
        "spec_verify_ct": last.spec_verify_ct,
        "finish_reason": last.finish_reason,
        "dp_rank": last.dp_rank,
    }
    if body.return_logprob:
        # SGLang's entries: [logprob, token id, its text (return_text_in_logprobs) or null].
        def entry(token: int, logprob: float) -> list:
            return [logprob, token, tm.tokenizer.decode([token]) if body.return_text_in_logprobs else None]

        meta["output_token_logprobs"] = [
            entry(t, lp) for c in chunks for t, lp in zip(c.token_ids, c.logprobs, strict=True)
        ]
        if body.top_logprobs_num:
            meta["output_top_logprobs"] = [
                [entry(t, lp) for t, lp in top] for c in chunks for top in c.top_logprobs
            ]
    return {
        "text": "".join(c.text for c in chunks),
        "output_ids": [t for c in chunks for t in c.token_ids],
        "meta_info": meta,
    }


async def _native_stream(tm: TokenizerManager, stream, body: GenerateRequestBody):
    # As SGLang does, every event carries the whole text so far.
    seen: list[Chunk] = []
    async for _, chunk in merge([stream]):
        seen.append(chunk)
        yield sse(_native_output(tm, seen, body))
    error = abort_event(seen[-1:])
    if error is not None:  # after the last event, whose finish_reason says {"type": "abort", ...}
        yield error
    yield sse("[DONE]")
