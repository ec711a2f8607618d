"""Per-request sampling, stopping and detokenization parameters (SGLang's names)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

# The bounds every request field is held to before a request is queued (`SamplingParams.validate`,
# and the HTTP models' schema in dpserve/server/protocol.py): what the engine can represent and stage
# in one int64 tensor, and list sizes that keep one request's per-step host work small.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STOP = 64  # stop strings, and each one's characters up to MAX_STOP_CHARS
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries
MAX_TOP_LOGPROBS = 20
# A temperature below this samples greedily (vLLM's rule): dividing by a smaller one overflows float32.
GREEDY_BELOW = 1e-5

# SGLang sampling parameters accepted only at their neutral value (n > 1 inside one /generate
# prompt): any other value is refused, naming the parameter.
NEUTRAL = {"n": (1, None)}


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0  # EOS and stop_token_ids cannot be sampled before; stop strings not matched
    temperature: float = 1.0  # 0 (anything below GREEDY_BELOW) means greedy
    top_k: int = -1  # -1 (or anything above the vocabulary): whole vocabulary
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None  # per-request seed: the same seed gives the same tokens
    # Penalties (dpserve/worker/sampler.py): OpenAI's over the generated tokens, subtracted from the
    # logits; repetition as SGLang and Hugging Face, over prompt and generated tokens (> 1 discourages).
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    top_logprobs_num: int = 0  # with return_logprob: the most likely alternatives at each position
    # Detokenization (the front end's): special tokens in the text, and the matched stop string kept.
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    # Structured output (dpserve/grammar.py), one at most: the tokens sampled follow this JSON schema
    # (as a JSON string), regular expression or EBNF grammar (xgrammar's dialect, rule `root` first).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    @classmethod
    def from_dict(cls, d: dict | None) -> SamplingParams:
        """From SGLang's sampling_params dict: `sampling_seed` is another name for `seed`, and
        logit_bias keys may be strings (JSON's)."""
        d = dict(d or {})
        for name, accepted in NEUTRAL.items():
            if name in d and d.pop(name) not in accepted:
                raise ValueError(f"{name} is not supported (only {' or '.join(map(_json, accepted))})")
        if "sampling_seed" in d:
            seed = d.pop("sampling_seed")
            if d.get("seed") not in (None, seed):
                raise ValueError(f"seed={d['seed']} and sampling_seed={seed} differ")
            d["seed"] = seed
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        if isinstance(d.get("logit_bias"), dict):
            d["logit_bias"] = {_token_id(k): v for k, v in d["logit_bias"].items()}
        params = cls(**d)
        params.validate()
        return params

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Whether sampling needs the request's token counts (frequency, presence, repetition)."""
        return self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1

    def validate(self) -> None:
        """Raises ValueError naming the first field out of its bounds: numbers finite, integers
        within int64, lists bounded. Every request passes here before it is queued (the engine's
        `check_request`), so the workers only ever see values they can stage."""

        def number(v, lo: float = -math.inf, hi: float = math.inf) -> bool:
            return (
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and lo <= v <= hi
            )

        def integer(v, lo: int = INT64_MIN, hi: int = INT64_MAX) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi

        max_new = self.max_new_tokens if integer(self.max_new_tokens) else 0
        checks = [
            (integer(self.max_new_tokens, 1), "max_new_tokens must be an int >= 1"),
            (
                integer(self.min_new_tokens, 0, max_new),
                "min_new_tokens must be an int in [0, max_new_tokens]",
            ),
            (number(self.temperature, 0.0), "temperature must be a number >= 0"),
            (
                integer(self.top_k) and (self.top_k == -1 or self.top_k >= 1),
                "top_k must be -1 or an int >= 1",
            ),
            (number(self.top_p, 0.0, 1.0) and self.top_p > 0.0, "top_p must be in (0, 1]"),
            (number(self.min_p, 0.0, 1.0), "min_p must be in [0, 1]"),
            (self.seed is None or integer(self.seed), "seed must be an int or None"),
            (number(self.frequency_penalty, -2.0, 2.0), "frequency_penalty must be in [-2, 2]"),
            (number(self.presence_penalty, -2.0, 2.0), "presence_penalty must be in [-2, 2]"),
            (
                number(self.repetition_penalty, 0.0, 2.0) and self.repetition_penalty > 0.0,
                "repetition_penalty must be in (0, 2]",
            ),
            (
                isinstance(self.logit_bias, dict)
                and len(self.logit_bias) <= MAX_LOGIT_BIAS
                and all(integer(t) and number(b, -100.0, 100.0) for t, b in self.logit_bias.items()),
                f"logit_bias must map token ids to numbers in [-100, 100] (at most {MAX_LOGIT_BIAS} entries)",
            ),
            (
                isinstance(self.stop_token_ids, list)
                and len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS
                and all(integer(t) for t in self.stop_token_ids),
                f"stop_token_ids must be a list of ints (at most {MAX_STOP_TOKEN_IDS})",
            ),
            (
                integer(self.top_logprobs_num, 0, MAX_TOP_LOGPROBS),
                f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}]",
            ),
        ]
        checks += [
            (getattr(self, name) is None or isinstance(getattr(self, name), str), f"{name} must be a string")
            for name in ("json_schema", "regex", "ebnf")
        ]
        checks += [
            (isinstance(getattr(self, name), bool), f"{name} must be a bool")
            for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"{message}, got {_shown(self)}")


def check_stop_strings(stop: object) -> list[str]:
    """The stop strings of a request as a list (one string or a list of them), within bounds."""
    stop = [stop] if isinstance(stop, str) else stop
    if not (
        isinstance(stop, list)
        and len(stop) <= MAX_STOP
        and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop)
    ):
        raise ValueError(
            f"stop must be a string or a list of at most {MAX_STOP} strings, each of 1 to "
            f"{MAX_STOP_CHARS} characters"
        )
    return stop


def _shown(params: SamplingParams, limit: int = 400) -> str:
    """The parameters for an error message, cut short (a field may hold a thousand entries)."""
    text = repr(params)
    return text if len(text) <= limit else text[:limit] + "...)"


def _token_id(key: object) -> object:
    """A logit_bias key as a token id ("42" -> 42); anything else is left for validate to refuse."""
    if isinstance(key, str) and key.strip().lstrip("-").isdigit():
        return int(key)
    return key


def _json(value: object) -> str:
    return "null" if value is None else repr(value)
