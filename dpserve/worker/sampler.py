"""Token sampling on a group leader, every row at once on the logits' device: penalties, logit bias
and the min_new_tokens floor, then greedy, temperature, top-k, top-p, min-p, per-request seeds; the
acceptance of speculative drafts; the top alternatives logprobs report."""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from itertools import accumulate
from typing import NamedTuple

import torch

from dpserve.grammar import apply_bitmask
from dpserve.models.batch import stage
from dpserve.sampling_params import SamplingParams
from dpserve.speculative.rejection import greedy_accept, rejection_sample
from dpserve.worker.token_counts import TokenCounts


@dataclass
class Penalties:
    """What one step's sampled requests (in order) need beyond their SamplingParams: their rows of
    `counts` (-1: no penalty), and for the min_new_tokens floor how many more tokens each must
    generate before it may stop and the tokens that would stop it (EOS unless ignored, stop ids)."""

    counts: TokenCounts
    rows: list[int]
    min_left: list[int]
    stop_ids: list[list[int]]


class GrammarMask(NamedTuple):
    """The tokens each constrained logits row allows (`dpserve.grammar`: a bitmask with one row per
    logits row, on the host) and which rows it constrains."""

    bitmask: torch.Tensor
    rows: list[int]


class Samples(NamedTuple):
    """Per request: its new tokens, their log-probabilities under the model's distribution, at
    each new token the `top_logprobs_num` most likely (token, logprob) alternatives (empty lists
    when it asked for none), and why it cannot go on (None while it can): a row whose logits allow
    no token (all -inf or NaN) is never sampled; its request ends with the tokens before it."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    top_logprobs: list[list[list[tuple[int, float]]]]
    errors: list[str | None]


NO_TOKEN = (
    "no token can be sampled: every logit is -inf or NaN after the request's penalties, logit_bias, "
    "min_tokens (which forbids its stop tokens) and grammar"
)


def sample(*args, **kwargs) -> Samples:
    """`launch_sample(...)` (its arguments) read back at once (`SampleLaunch.result`)."""
    return launch_sample(*args, **kwargs).result()


def launch_sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    keys: list[tuple[int, int]],
    drafts: list[list[int]] | None = None,
    penalties: Penalties | None = None,
    grammar: GrammarMask | None = None,
) -> SampleLaunch:
    """Chooses each request's new tokens on the device, with their log-probabilities under the
    model's distribution (before penalties and filters) and the top alternatives asked for; the
    host reads them with `SampleLaunch.result()`.

    Request i owns 1 + len(drafts[i]) consecutive rows of `logits` (its last token and its drafts,
    verified in one step) and gets 1 to 1 + len(drafts[i]) tokens: greedy keeps the longest prefix
    of drafts equal to the argmax plus the next argmax; sampling accepts drafts by speculative
    rejection sampling, which leaves the (filtered) target distribution exactly as it is, and draws
    by the exponential race (argmax of p / E with E ~ Exp(1)). Request i's randomness is a function
    of keys[i] = (its seed, tokens it generated before this step) and of the row only
    (`uniforms`), so seeded outputs do not depend on the batch they ran in. Penalties, logit bias and
    the min_new_tokens floor change the logits both choices start from (`adjust_inputs`), then the
    grammar masks what its rows forbid (a verify step's rows as the drafts before them leave it).

    The whole batch costs the same number of device ops whatever its size: the host inputs reach
    the device in one staged copy, the results come back in one transfer (the step's one sync)."""
    drafts = drafts or [[] for _ in params]
    starts = [0, *accumulate(1 + len(d) for d in drafts)]
    ints: dict[str, list[int]] = {}
    floats: dict[str, list[float]] = {}
    adjusting = adjust_inputs(params, drafts, starts, penalties, ints, floats)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        _sampling_inputs(params, keys, drafts, starts, sampled, ints, floats)
    top_n = max((p.top_logprobs_num for p in params), default=0)
    if top_n:
        ints["top_rows"] = [
            r for i, p in enumerate(params) if p.top_logprobs_num for r in range(starts[i], starts[i + 1])
        ]
    t = stage(ints, logits.device, floats)
    counts = penalties.counts if adjusting and penalties else None
    flat, row_tokens = _choose(logits, t, adjusting, counts, grammar, len(sampled), top_n)
    return SampleLaunch(flat, row_tokens, params, drafts, starts, sampled, ints.get("top_rows", []), top_n)


class SampleLaunch:
    """One step's samples on the device. `row_tokens` is every logits row's token there (overlap
    scheduling feeds it to the next step's inputs without waiting for it); `result()` reads the
    samples on the host: the step's one sync, which a GPU's copy to pinned memory lets the host put
    off while later work is queued."""

    def __init__(
        self,
        flat: torch.Tensor,
        row_tokens: torch.Tensor,
        params: list[SamplingParams],
        drafts: list[list[int]],
        starts: list[int],
        sampled: list[int],
        top_rows: list[int],
        top_n: int,
    ):
        self.row_tokens = row_tokens
        self._host, self._copied = flat, None
        if flat.is_cuda:
            self._host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            self._host.copy_(flat, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        self._params, self._drafts, self._starts = params, drafts, starts
        self._sampled, self._top_rows, self._top_n = sampled, top_rows, top_n

    def result(self) -> Samples:
        if self._copied is not None:
            self._copied.synchronize()
        flat = self._host.tolist()
        params, starts, sampled, n = self._params, self._starts, self._sampled, self._starts[-1]
        accepted_of = dict(zip(sampled, (int(x) for x in flat[3 * n : 3 * n + len(sampled)]), strict=True))
        tokens, lps, errors = _emitted(params, self._drafts, starts, flat[: 3 * n], accepted_of)
        top: list[list[list[tuple[int, float]]]] = [[[] for _ in toks] for toks in tokens]
        if self._top_n:
            _fill_top(top, flat[3 * n + len(sampled) :], self._top_rows, starts, params, self._top_n)
        return Samples(tokens, lps, top, errors)


def _choose(
    logits: torch.Tensor,
    t: dict[str, torch.Tensor],
    adjusting: bool,
    counts: TokenCounts | None,
    grammar: GrammarMask | None,
    sampled: int,
    top_n: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """On the device: every row's token, its logprob under the model and whether any token could
    be sampled, then the sampled requests' accepted drafts, then the top alternatives (values, ids),
    in one tensor to bring back in one transfer; and every row's token."""
    logits = logits.float()
    logprobs = logits.log_softmax(-1)
    if adjusting:
        logits = adjust_logits(logits, t, counts)
    if grammar is not None:
        apply_bitmask(logits, *grammar)  # in place: `logprobs` above is its own tensor
    usable = logits.amax(-1) > float("-inf")  # False for a row all -inf or holding a NaN
    tok = logits.argmax(-1)  # each row's token: the greedy choice, or for sampled rows as below
    if sampled:
        sampled_tok, accepted = _draw(logits, t, sampled)
        tok = tok.index_copy(0, t["rows"], sampled_tok)
    parts = [tok.double(), logprobs.gather(1, tok[:, None])[:, 0].double(), usable.double()]
    if sampled:
        parts.append(accepted.double())
    if top_n:
        values, ids = logprobs[t["top_rows"]].topk(top_n)
        parts += [values.double().flatten(), ids.double().flatten()]
    return torch.cat(parts), tok


def _draw(
    logits: torch.Tensor, t: dict[str, torch.Tensor], requests: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampled requests' rows: their filtered distributions, drafts accepted by rejection
    sampling and the next token drawn (the exponential race), from the rows' own uniforms."""
    probs = filtered_probs(logits[t["rows"]], t["temperature"], t["top_k"], t["top_p"], t["min_p"])
    u = uniforms(t["seed_lo"], t["seed_hi"], t["counter"], probs.shape[1] + 1)
    return rejection_sample(
        probs,
        t["draft"],
        t["has_draft"] != 0,
        u[:, -1],
        -u[:, :-1].log(),
        t["segments"].view(requests, -1),
        t["row_req"],
        t["row_j"],
    )


def _emitted(
    params: list[SamplingParams],
    drafts: list[list[int]],
    starts: list[int],
    rows: list[float],
    accepted_of: dict[int, int],
) -> tuple[list[list[int]], list[list[float]], list[str | None]]:
    """Each request's tokens and logprobs from its rows' (`rows`: every row's token, then its
    logprob, then whether it could be sampled), none past a row that could not, and why not."""
    n = starts[-1]
    row_tok, row_lp, row_ok = [int(x) for x in rows[:n]], rows[n : 2 * n], rows[2 * n : 3 * n]
    tokens, lps, errors = [], [], []
    for i, p in enumerate(params):
        first, last = starts[i], starts[i + 1]
        # Rows before the emitted one hold the accepted drafts (sampling) or the argmax (greedy).
        count = len(greedy_accept(drafts[i], row_tok[first:last])) if p.greedy else 1 + accepted_of[i]
        good = next((k for k in range(count) if not row_ok[first + k]), count)
        tokens.append(row_tok[first : first + good])
        lps.append(row_lp[first : first + good])
        errors.append(None if good == count else NO_TOKEN)
    return tokens, lps, errors


def _fill_top(
    top: list[list[list[tuple[int, float]]]],
    flat: list[float],
    top_rows: list[int],
    starts: list[int],
    params: list[SamplingParams],
    top_n: int,
) -> None:
    """The top alternatives of every emitted token that asked for them, from `flat` (the top_n
    values of each of `top_rows`, then their ids)."""
    values, ids = flat[: len(flat) // 2], [int(x) for x in flat[len(flat) // 2 :]]
    for k, row in enumerate(top_rows):
        i = bisect_right(starts, row) - 1
        if row - starts[i] < len(top[i]):
            num = params[i].top_logprobs_num
            pairs = zip(ids[k * top_n : k * top_n + num], values[k * top_n : k * top_n + num], strict=True)
            top[i][row - starts[i]] = list(pairs)


def _sampling_inputs(
    params: list[SamplingParams],
    keys: list[tuple[int, int]],
    drafts: list[list[int]],
    starts: list[int],
    sampled: list[int],
    ints: dict[str, list[int]],
    floats: dict[str, list[float]],
) -> None:
    """The host inputs of the sampled requests' rows: which rows, their filters, their random keys
    (row j of a request verifying drafts draws as its j-th next token would), the draft each row
    verifies (0 and has_draft 0 on a request's last row), and each request's rows as one padded
    row of `segments` (padding: the row count, an index past every row)."""
    rows = [(q, i, j) for q, i in enumerate(sampled) for j in range(1 + len(drafts[i]))]
    width = 1 + max(len(drafts[i]) for i in sampled)
    ints["rows"] = [starts[i] + j for _, i, j in rows]
    ints["top_k"] = [params[i].top_k if params[i].top_k > 0 else 1 << 62 for _, i, _ in rows]
    ints["seed_lo"] = [keys[i][0] & MASK32 for _, i, _ in rows]
    ints["seed_hi"] = [(keys[i][0] >> 32) & MASK32 for _, i, _ in rows]
    ints["counter"] = [(keys[i][1] + j) & MASK32 for _, i, j in rows]
    ints["draft"] = [drafts[i][j] if j < len(drafts[i]) else 0 for _, i, j in rows]
    ints["has_draft"] = [int(j < len(drafts[i])) for _, i, j in rows]
    ints["row_req"] = [q for q, _, _ in rows]
    ints["row_j"] = [j for _, _, j in rows]
    segments, first = [], 0
    for i in sampled:
        k = len(drafts[i])
        segments += [*range(first, first + k + 1), *[len(rows)] * (width - 1 - k)]
        first += k + 1
    ints["segments"] = segments
    floats["temperature"] = [params[i].temperature for _, i, _ in rows]
    floats["top_p"] = [params[i].top_p if params[i].top_p < 1 else 2.0 for _, i, _ in rows]
    floats["min_p"] = [params[i].min_p for _, i, _ in rows]


def adjust_inputs(
    params: list[SamplingParams],
    drafts: list[list[int]],
    starts: list[int],
    penalties: Penalties | None,
    ints: dict[str, list[int]],
    floats: dict[str, list[float]],
) -> bool:
    """The host inputs of `adjust_logits`, which changes the logits sampling starts from, for the
    whole batch at once; False when there is nothing to change:

    1. repetition_penalty (Hugging Face's and SGLang's): the logit of a token seen in the prompt or
       generated is divided by the penalty when positive, multiplied by it otherwise;
    2. frequency and presence penalties (OpenAI's): minus count x frequency_penalty, minus
       presence_penalty if the count is > 0, counting generated tokens only;
    3. logit_bias added;
    4. while a request has generated fewer than min_new_tokens, the tokens that would stop it are
       impossible (-inf).

    Row j of a request verifying drafts counts drafts[:j] as generated (they precede its position),
    so every verified position sees exactly what decoding one token at a time would have seen, and
    speculative decoding gives the same tokens (greedy) or distribution (sampling) as without."""
    spans = [range(starts[i], starts[i + 1]) for i in range(len(params))]
    if penalties is not None and any(r >= 0 for r in penalties.rows):
        # The logit rows of requests with a penalty, the count row of each, the drafts row j counts.
        rows = [(i, j, r) for i, c in enumerate(penalties.rows) if c >= 0 for j, r in enumerate(spans[i])]
        ints["pen_rows"] = [r for _, _, r in rows]
        ints["pen_counts"] = [penalties.rows[i] for i, _, _ in rows]
        drafted = [(k, t) for k, (i, j, _) in enumerate(rows) for t in drafts[i][:j]]
        ints["drafted_at"], ints["drafted"] = [k for k, _ in drafted], [t for _, t in drafted]
        floats["repetition"] = [params[i].repetition_penalty for i, _, _ in rows]
        floats["frequency"] = [params[i].frequency_penalty for i, _, _ in rows]
        floats["presence"] = [params[i].presence_penalty for i, _, _ in rows]
    bias = [(r, t, b) for i, p in enumerate(params) for r in spans[i] for t, b in p.logit_bias.items()]
    if bias:
        ints["bias_rows"], ints["bias_tokens"] = [r for r, _, _ in bias], [t for _, t, _ in bias]
        floats["bias"] = [b for _, _, b in bias]
    if penalties is not None:
        banned = [
            (starts[i] + j, t)
            for i, left in enumerate(penalties.min_left)
            for j in range(min(left, len(spans[i])))
            for t in penalties.stop_ids[i]
        ]
        if banned:
            ints["banned_rows"], ints["banned"] = [r for r, _ in banned], [t for _, t in banned]
    return any(k in ints for k in ("pen_rows", "bias_rows", "banned_rows"))


def adjust_logits(
    logits: torch.Tensor, t: dict[str, torch.Tensor], counts: TokenCounts | None
) -> torch.Tensor:
    """The logits after `adjust_inputs`' changes (a new tensor), from its staged inputs `t`."""
    out = logits.clone()
    if "pen_rows" in t:
        at, count_at = t["pen_rows"], t["pen_counts"]
        generated = counts.output[count_at]  # a copy, [rows, vocab]
        if len(t["drafted"]):
            ones = torch.ones_like(t["drafted"], dtype=generated.dtype)
            generated.index_put_((t["drafted_at"], t["drafted"]), ones, accumulate=True)
        seen = counts.prompt[count_at] | (generated > 0)
        rep, freq, pres = (t[k].float()[:, None] for k in ("repetition", "frequency", "presence"))
        x = out[at]
        x = torch.where(seen, torch.where(x < 0, x * rep, x / rep), x)
        out[at] = x - generated * freq - (generated > 0) * pres
    if "bias_rows" in t:
        out.index_put_((t["bias_rows"], t["bias_tokens"]), t["bias"].float(), accumulate=True)
    out.clamp_(-FLOAT32_MAX, FLOAT32_MAX)  # penalties and biases never make a logit infinite
    if "banned_rows" in t:
        out[t["banned_rows"], t["banned"]] = float("-inf")
    return out


def filtered_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """Each row's distribution after temperature, top-k, top-p and min-p (one value per row each;
    top_p >= 1 and top_k >= vocabulary keep everything), renormalized."""
    probs = (logits / temperature.float()[:, None]).softmax(-1)
    sorted_probs, order = probs.sort(-1, descending=True)
    rank = torch.arange(logits.shape[1], device=logits.device)[None]
    keep = rank < top_k[:, None]
    # top_p: the smallest prefix whose mass reaches it (the top token always stays).
    keep &= sorted_probs.cumsum(-1) - sorted_probs < top_p.float()[:, None]
    keep &= sorted_probs >= min_p.float()[:, None] * sorted_probs[:, :1]
    keep[:, 0] = True  # whatever the float precision (top_p of 5e-324 is 0 in float32)
    filtered = torch.zeros_like(probs).scatter_(1, order, sorted_probs * keep)
    return filtered / filtered.sum(-1, keepdim=True)


MASK32 = 0xFFFFFFFF
FLOAT32_MAX = torch.finfo(torch.float32).max


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash on int64 values in [0, 2^32) (the multiplier is below 2^27,
    so no product overflows: the same bits on every device)."""
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & MASK32
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & MASK32
    return x ^ (x >> 16)


def uniforms(seed_lo: torch.Tensor, seed_hi: torch.Tensor, counter: torch.Tensor, width: int) -> torch.Tensor:
    """[rows, width] uniforms in (0, 1), a counter-based generator: row r's values are a hash of
    (seed_lo[r], seed_hi[r], counter[r]) and the column, so every row draws in the same few ops
    whatever the batch, and a request's draws depend on its seed and position only.

    23 random bits: (bits + 0.5) * 2^-23 is then exact in float32, at most 1 - 2^-24. With 24 bits
    the top value rounded to 1.0, its Exp(1) draw -log(u) was 0, and in the exponential race a token
    of probability 0 (masked by a grammar, cut by top-k) scored 0 / 0 = NaN, which argmax picks."""
    key = _mix32(_mix32(_mix32(seed_hi) ^ seed_lo) ^ counter)
    columns = _mix32(torch.arange(width, device=key.device))
    bits = _mix32(key[:, None] ^ columns[None]) >> 9
    return (bits.float() + 0.5) * 2.0**-23
