"""Per-request sampling and stopping parameters (SGLang's names)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 means greedy
    top_k: int = -1  # -1: whole vocabulary
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None  # per-request seed: the same seed gives the same tokens
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    @classmethod
    def from_dict(cls, d: dict | None) -> SamplingParams:
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        params = cls(**d)
        params.validate()
        return params

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self) -> None:
        def number(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        def integer(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        checks = [
            (integer(self.max_new_tokens) and self.max_new_tokens >= 1, "max_new_tokens must be an int >= 1"),
            (number(self.temperature) and self.temperature >= 0.0, "temperature must be a number >= 0"),
            (
                integer(self.top_k) and (self.top_k == -1 or self.top_k >= 1),
                "top_k must be -1 or an int >= 1",
            ),
            (number(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (number(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (self.seed is None or integer(self.seed), "seed must be an int or None"),
            (
                isinstance(self.stop_token_ids, list) and all(integer(t) for t in self.stop_token_ids),
                "stop_token_ids must be a list of ints",
            ),
            (isinstance(self.ignore_eos, bool), "ignore_eos must be a bool"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"{message}, got {self}")
