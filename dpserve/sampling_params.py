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
        checks = [
            (
                isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1,
                "max_new_tokens must be >= 1",
            ),
            (self.temperature >= 0.0, "temperature must be >= 0"),
            (self.top_k == -1 or self.top_k >= 1, "top_k must be -1 or >= 1"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"{message}, got {self}")
