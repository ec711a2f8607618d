"""Structured output through xgrammar: a request's grammar (SGLang's `json_schema`, `regex` or
`ebnf`; OpenAI's `response_format` becomes a JSON schema) is checked where the request enters
(`check_grammar`: a syntax error is the client's 400, before anything is queued), compiled on its
DP group's leader off the step loop and cached by its text (`GrammarCache`), and followed there by
one `Matcher` per request: the leader samples for the whole group, so the group cannot disagree.

Each step the leader fills the constrained rows of a token bitmask (`Matcher.fill`) right after the
forward is launched (on a GPU it runs meanwhile), and the sampler applies it after penalties and
logit bias. A verify step's rows are filled as the drafts would leave the matcher and rolled back.
xgrammar is imported only when a request asks for a grammar (it takes ~1.5 s).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import xgrammar

    from dpserve.sampling_params import SamplingParams

KINDS = ("json_schema", "regex", "ebnf")  # SGLang's sampling parameters, one per request at most
JSON_OBJECT = '{"type": "object"}'  # OpenAI's response_format json_object: any JSON object
COUNTERS = ("grammar_compiles", "grammar_cache_hits", "grammar_compile_seconds")  # of a group, in /metrics


def grammar_key(params: SamplingParams) -> tuple[str, str] | None:
    """(kind, text) of the request's grammar; None when it has none."""
    for kind in KINDS:
        text = getattr(params, kind)
        if text is not None:
            return kind, text
    return None


def check_grammar(params: SamplingParams, backend: str) -> None:
    """Raises ValueError naming what is wrong with the request's grammar: more than one given, no
    backend, or text xgrammar cannot parse (the JSON, the schema, the pattern, the EBNF)."""
    given = [k for k in KINDS if getattr(params, k) is not None]
    if len(given) > 1:
        raise ValueError(f"at most one of json_schema, regex and ebnf may be given, got {', '.join(given)}")
    if not given:
        return
    if backend == "none":
        raise ValueError(f"{given[0]} needs a grammar backend: this server runs with --grammar-backend none")
    import xgrammar as xgr

    kind, text = given[0], getattr(params, given[0])
    try:
        if kind == "json_schema":
            json.loads(text)  # a clearer message than xgrammar's for plain JSON errors
            xgr.Grammar.from_json_schema(text)
        elif kind == "regex":
            xgr.Grammar.from_regex(text)
        else:
            xgr.Grammar.from_ebnf(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"json_schema is not valid JSON: {e}") from None
    except RuntimeError as e:
        raise ValueError(f"invalid {kind}: {_xgrammar_message(e)}") from None


def _xgrammar_message(error: Exception) -> str:
    """xgrammar's message without its C++ source location and check expression."""
    text = str(error).strip()
    text = re.sub(r"^\[[\d:.]+\] \S+:\d+: ", "", text)
    text = re.sub(r"^Check failed: .*? is false: ", "", text)
    return text.split("\n")[0]


class GrammarCache:
    """Compiles grammars on one background thread, a request at a time in arrival order, and keeps
    the last `capacity` compiled ones (least recently used dropped first) by their text. `counters`
    go to /metrics: compiles, cache hits and compile seconds."""

    def __init__(
        self, model_path: str, vocab_size: int, eos_ids: tuple[int, ...], capacity: int, max_whitespace: int
    ):
        self.model_path, self.vocab_size, self.eos_ids = model_path, vocab_size, eos_ids
        self.capacity, self.max_whitespace = capacity, max_whitespace
        self._compiler: xgrammar.GrammarCompiler | None = None  # built on the first grammar
        self._entries: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._lock = threading.Lock()  # counters are added to by the compile thread
        self.counters: dict[str, float] = dict.fromkeys(COUNTERS, 0)

    def get(self, key: tuple[str, str]) -> Future:
        """The compiled grammar of `key`, now (a hit) or once compiled; its exception if it fails."""
        future = self._entries.get(key)
        if future is not None and not (future.done() and future.exception() is not None):
            self._entries.move_to_end(key)
            self.counters["grammar_cache_hits"] += 1
            return future
        future = self._pool.submit(self._compile, key)
        self._entries[key] = future
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return future

    def _compile(self, key: tuple[str, str]) -> xgrammar.CompiledGrammar:
        start = time.perf_counter()
        compiler = self._compiler or self._make_compiler()
        kind, text = key
        if kind == "json_schema":
            compiled = compiler.compile_json_schema(
                json.dumps(_lengths_as_patterns(json.loads(text))),
                any_whitespace=self.max_whitespace > 0,
                max_whitespace_cnt=self.max_whitespace or None,
            )
        elif kind == "regex":
            compiled = compiler.compile_regex(text)
        else:
            compiled = compiler.compile_grammar(text)
        with self._lock:
            self.counters["grammar_compiles"] += 1
            self.counters["grammar_compile_seconds"] += time.perf_counter() - start
        return compiled

    def _make_compiler(self) -> xgrammar.GrammarCompiler:
        import xgrammar as xgr

        from dpserve.models.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(self.model_path)
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size, stop_token_ids=list(self.eos_ids)
        )
        # Our own cache above is the bounded one; xgrammar's would grow without bound.
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# A JSON string's unescaped characters: no control character, quote or backslash, and no surrogate
# (U+D800-U+DFFF), spelled as ranges of literal characters. xgrammar 0.2.9 turns a negated class
# such as [^\x00-\x1f"\\] into bytes that also admit UTF-8-encoded surrogates and overlong forms
# (ED AA 9A, E0 84 95): invalid UTF-8, decoded as three U+FFFD where the grammar counted one
# character; its ranges of literal characters give exactly the valid UTF-8 sequences.
STRING_CHAR = f"[ !#-\\[\\]-{chr(0xD7FF)}{chr(0xE000)}-{chr(0x10FFFF)}]"


def _lengths_as_patterns(schema: object) -> object:
    """The schema with each string's minLength / maxLength (and no pattern or format) written as the
    same bound on a pattern of JSON string characters (`STRING_CHAR`). xgrammar 0.2.9 compiles a
    length-bounded string to a rule that admits raw control characters (U+0000-U+001F), which JSON
    forbids in a string and parsers such as `json.loads` and pydantic refuse, and its own classes
    admit invalid UTF-8, which breaks the bound."""
    if isinstance(schema, list):
        return [_lengths_as_patterns(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _lengths_as_patterns(v) for k, v in schema.items()}
    bounded = "minLength" in out or "maxLength" in out
    if out.get("type") == "string" and bounded and not {"pattern", "format", "enum", "const"} & set(out):
        low, high = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = f"^{STRING_CHAR}{{{low},{high}}}$"
    return out


class Matcher:
    """One request's place in its grammar. `stop_ids` end it once the grammar is complete (EOS and
    the request's stop_token_ids); with none, it ends on the grammar's last token."""

    def __init__(self, compiled: xgrammar.CompiledGrammar, stop_ids: list[int]):
        import xgrammar as xgr

        self._m = xgr.GrammarMatcher(
            compiled, override_stop_tokens=stop_ids or None, terminate_without_stop_token=not stop_ids
        )

    def fill(self, bitmask: torch.Tensor, row: int, drafts: list[int]) -> None:
        """Rows `row`, `row + 1`, ... of `bitmask`: the tokens allowed next, then after each draft in
        turn while the grammar accepts it (rows after a refused draft stay all-allowed: the draft is
        rejected there whatever they hold). The matcher ends where it began."""
        accepted = 0
        for j in range(len(drafts) + 1):
            self._m.fill_next_token_bitmask(bitmask, row + j)
            if j == len(drafts) or not self._m.accept_token(drafts[j]):
                break
            accepted += 1
        if accepted:
            self._m.rollback(accepted)

    def accept(self, token: int) -> bool:
        """Moves past `token`; False if the grammar does not allow it."""
        return self._m.accept_token(token)

    @property
    def terminated(self) -> bool:
        return self._m.is_terminated()


def token_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A bitmask of `rows` rows that allows every token (int32, 32 tokens a word)."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Sets to -inf, in place, the float32 logits of `rows` that their bitmask rows forbid: on the
    CPU by the fused kernel (xgrammar's CPU kernel took 3 ms for 16 rows of SmolLM2's 49,152
    tokens, ~6% of a decode step), elsewhere by xgrammar's."""
    from dpserve import cpu_ops

    if cpu_ops.usable(logits):
        picked = bitmask[rows].contiguous()
        torch.ops.dpserve_cpu.apply_token_bitmask(logits, picked, torch.tensor(rows, dtype=torch.long))
        return
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows)
