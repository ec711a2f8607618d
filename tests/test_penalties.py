"""Penalties, logit bias, min_new_tokens and top logprobs: the sampler against the plain reference
(`dpserve.testing.reference.reference_logits`), the device token counts against a recount, and the
engine under DP attention against transformers decoding with the same rules."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import NEW_TOKENS, engine_for

from dpserve.messages import GenerateRequest
from dpserve.models.batch import stage
from dpserve.sampling_params import SamplingParams
from dpserve.scheduler.scheduler import Scheduler
from dpserve.speculative.rejection import greedy_accept
from dpserve.testing.reference import _load_model, hf_sampling_reference, reference_logits
from dpserve.worker.sampler import Penalties, adjust_inputs, adjust_logits, sample
from dpserve.worker.sampling_batch import count_tokens, follow_counts, sampling_inputs
from dpserve.worker.token_counts import TokenCounts

VOCAB = 50
EOS = 1


def make_batch(seed: int):
    """Six requests with every kind of adjustment (and one with none), some verifying drafts."""
    rng = random.Random(seed)
    params = [
        SamplingParams(temperature=0, repetition_penalty=1.7),
        SamplingParams(temperature=0, frequency_penalty=0.9, presence_penalty=-0.4),
        SamplingParams(temperature=0, logit_bias={3: 2.5, 7: -1.0}, min_new_tokens=9, stop_token_ids=[5]),
        SamplingParams(temperature=0),
        SamplingParams(
            temperature=0,
            repetition_penalty=0.8,
            frequency_penalty=-0.3,
            presence_penalty=0.6,
            min_new_tokens=4,
        ),
        SamplingParams(temperature=0, presence_penalty=1.1, logit_bias={4: 100}),
    ]
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))] for _ in params]
    generated = [[rng.randrange(8) for _ in range(rng.randrange(0, 10))] for _ in params]  # many repeats
    drafts = [[rng.randrange(8) for _ in range(k)] for k in (3, 0, 2, 1, 3, 0)]
    return params, prompts, generated, drafts


def stop_ids(p: SamplingParams) -> set[int]:
    return set(p.stop_token_ids) | (set() if p.ignore_eos else {EOS})


def fill_counts(params, prompts, generated, max_rows: int = 8) -> tuple[TokenCounts, list[int]]:
    """Token counts as the scheduler keeps them: a row per penalized request, filled at admission
    from half its history, the rest counted a token per step."""
    counts = TokenCounts(VOCAB, max_rows)
    penalized = [i for i, p in enumerate(params) if p.penalized]
    for i in penalized:
        counts.acquire(str(i), prompts[i], generated[i][: len(generated[i]) // 2])
    for k in range(max(map(len, generated))):
        step = [
            (str(i), generated[i][k]) for i in penalized if len(generated[i]) // 2 <= k < len(generated[i])
        ]
        counts.add([rid for rid, _ in step], [t for _, t in step])
    return counts, [counts.rows.get(str(i), -1) for i in range(len(params))]


def test_adjusted_logits_match_the_reference_at_every_verified_position():
    for seed in range(5):
        params, prompts, generated, drafts = make_batch(seed)
        counts, rows = fill_counts(params, prompts, generated)
        min_left = [max(0, p.min_new_tokens - len(g)) for p, g in zip(params, generated, strict=True)]
        penalties = Penalties(counts, rows, min_left, [sorted(stop_ids(p)) for p in params])
        starts = [0]
        for d in drafts:
            starts.append(starts[-1] + 1 + len(d))
        logits = torch.randn(starts[-1], VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
        ints, floats = {}, {}
        adjust_inputs(params, drafts, starts, penalties, ints, floats)
        out = adjust_logits(logits, stage(ints, logits.device, floats), counts)
        for i, p in enumerate(params):
            for j in range(1 + len(drafts[i])):  # row j: the drafts before it count as generated
                row = starts[i] + j
                expected = reference_logits(
                    logits[row], prompts[i], generated[i] + drafts[i][:j], p, stop_ids(p)
                )
                torch.testing.assert_close(out[row], expected, rtol=0, atol=1e-5)
                assert out[row].argmax() == expected.argmax()
        # Greedy acceptance of the drafts follows the changed logits; logprobs stay the model's.
        samples = sample(logits, params, [(0, 0)] * len(params), drafts, penalties)
        for i in range(len(params)):
            rows_i = range(starts[i], starts[i + 1])
            assert samples.tokens[i] == greedy_accept(drafts[i], [int(out[r].argmax()) for r in rows_i])
            raw = logits.log_softmax(-1)
            expected_lp = [float(raw[starts[i] + j, t]) for j, t in enumerate(samples.tokens[i])]
            assert samples.logprobs[i] == pytest.approx(expected_lp, abs=1e-6)


def test_min_new_tokens_masks_stop_tokens_until_reached():
    """Sampling (not greedy) too: a stop token with almost all the mass is never drawn early."""
    logits = torch.full((4, VOCAB), -10.0)
    logits[:, EOS] = 10.0
    logits[:, 5] = 9.0
    params = [SamplingParams(temperature=1.0, min_new_tokens=3, stop_token_ids=[5])] * 4
    counts = TokenCounts(VOCAB, 4)
    penalties = Penalties(counts, [-1] * 4, [3, 2, 1, 0], [[EOS, 5]] * 4)
    tokens = sample(logits, params, [(s, 0) for s in range(4)], penalties=penalties).tokens
    assert all(t not in (EOS, 5) for (t,) in tokens[:3]) and tokens[3] in ([EOS], [5])


def test_top_logprobs_report_the_model_distribution():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0, top_logprobs_num=n, repetition_penalty=1.5) for n in (0, 1, 5)]
    counts = TokenCounts(VOCAB, 4)
    for i in range(3):
        counts.acquire(str(i), [int(logits[i].argmax())], [])  # the penalty changes the choice
    samples = sample(logits, params, [(0, 0)] * 3, penalties=Penalties(counts, [0, 1, 2], [0] * 3, [[]] * 3))
    values, ids = logits.log_softmax(-1).topk(5)
    assert samples.top_logprobs[0] == [[]]
    for i, n in ((1, 1), (2, 5)):
        (top,) = samples.top_logprobs[i]
        assert [t for t, _ in top] == ids[i, :n].tolist()
        assert [lp for _, lp in top] == pytest.approx(values[i, :n].tolist(), abs=1e-6)
        assert samples.tokens[i][0] != ids[i, 0]  # chosen under the penalty, reported as the model's


def test_token_counts_grow_reuse_rows_and_stop_at_max_rows():
    counts = TokenCounts(VOCAB, max_rows=6)
    for i in range(5):
        counts.acquire(str(i), [i], [i, i, 9])
    assert counts.output.shape == (6, VOCAB) and sorted(counts.rows.values()) == list(range(5))
    counts.release("2")
    counts.acquire("new", [7], [])
    counts.acquire("last", [8], [8])
    assert len(counts.output) == 6 and counts.output[counts.rows["new"]].sum() == 0
    assert counts.prompt[counts.rows["new"]].nonzero().flatten().tolist() == [7]
    counts.add(["new", "new", "0"], [3, 3, 9])
    assert counts.output[counts.rows["new"], 3] == 2 and counts.output[counts.rows["0"], 9] == 2
    with pytest.raises(RuntimeError, match="more than 6 requests with penalties"):
        counts.acquire("one too many", [1], [])


# --- a group leader's scheduler and sampler together, speculative or not --------------------------


def synthetic_logits(fill: list[int]) -> torch.Tensor:
    """A stand-in model: a favourite cycling through 3, 4, 5 (so prompt-lookup drafts get accepted,
    and a draft's own token competes again two positions later) and a runner-up close behind (so
    penalties change choices)."""
    logits = torch.zeros(VOCAB)
    logits[3 + (fill[-1] + 1) % 3] = 2.0
    logits[16 + (fill[-1] * 5 + 1) % 13] = 1.2
    return logits


def run_leader(params: list[SamplingParams], num_drafts: int, capacity: int) -> tuple[list[list[int]], dict]:
    """Every request to its end through Scheduler and sample, as a group leader runs them."""
    s = Scheduler(0, capacity, 8, 16, 100, VOCAB, eos_ids=(EOS,), seed=0, num_drafts=num_drafts)
    for i, p in enumerate(params):
        s.add(GenerateRequest(str(i), [3 + i, 9, 4 + 2 * i], p))
    outputs, counts = {}, TokenCounts(VOCAB, 8)  # kept beside the scheduler, as a leader keeps them
    while s.running or s.waiting:
        scheduled = s.schedule()
        follow_counts(counts, s.running, scheduled.sampled)
        i = sampling_inputs(scheduled.sampled, counts, s.vocab_size, s.eos_ids)
        rows = [
            synthetic_logits(r.fill_ids + r.drafts[:j])
            for r in scheduled.sampled
            for j in range(1 + len(r.drafts))
        ]
        samples = (
            sample(torch.stack(rows), i.params, i.keys, i.drafts, i.penalties, i.grammar)
            if rows
            else ([], [], [], [])
        )
        new, finished = s.process_samples(scheduled, *samples)
        count_tokens(counts, new)
        outputs.update((o.rid, o.output_ids) for o in finished)
    follow_counts(counts, s.running, [])
    assert counts.rows == {}
    return [outputs[str(i)] for i in range(len(params))], s.counters


def test_speculative_decoding_with_penalties_gives_the_tokens_of_one_at_a_time():
    """Every verified position sees the counts decoding one token at a time would: with NGRAM drafts
    (and retractions in a small pool) the outputs are those without speculation."""
    adjustments = [
        {"frequency_penalty": 0.5},
        {"presence_penalty": 0.9},
        {"repetition_penalty": 1.8},
        {"frequency_penalty": -0.3, "presence_penalty": 0.5, "min_new_tokens": 5, "logit_bias": {EOS: 3.0}},
        {},
    ]
    params = [
        SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=i != 3, **a)
        for i, a in enumerate(adjustments)
    ]
    plain, _ = run_leader([SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True)] * 5, 0, 400)
    one_at_a_time, _ = run_leader(params, 0, 400)
    assert [o != q for o, q in zip(one_at_a_time, plain, strict=True)] == [True] * 4 + [False]
    speculative, counters = run_leader(params, 3, 60)
    assert speculative == one_at_a_time
    assert counters["spec_accepted_tokens"] > 0 and counters["retractions"] > 0


# --- the engine under DP attention against transformers ------------------------------------------

ADJUSTED = [  # per prompt of the session's `prompts`; the first runs plain beside the others
    {},
    {"repetition_penalty": 1.8},
    {"logit_bias": {7: 3.0}},
    {"frequency_penalty": 1.5},
    {"presence_penalty": 1.5},
    {"frequency_penalty": -0.5, "presence_penalty": 0.7, "repetition_penalty": 1.3},
]


def adjusted_params(prompts, model_dir, eos_ids) -> list[SamplingParams]:
    """ADJUSTED, plus the first prompt again with a stop token its plain greedy output meets at
    step 3, held off by min_new_tokens."""
    base = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0}
    plain = hf_sampling_reference(model_dir, prompts[0], SamplingParams(**base, ignore_eos=True), eos_ids)
    held_off = SamplingParams(**base, min_new_tokens=6, stop_token_ids=[plain.output_ids[2]])
    return [SamplingParams(**base, ignore_eos=True, **a) for a in ADJUSTED] + [held_off]


def test_engine_penalties_match_transformers_under_dp_attention(engine_cache, model_dirs, prompts):
    model_dir = model_dirs["deepseek_v2"]
    engine = engine_for(engine_cache, model_dirs, "deepseek_v2", 2, 2)
    eos_ids = engine.model_cfg.eos_token_ids
    params = adjusted_params(prompts, model_dir, eos_ids)
    batch = [*prompts, prompts[0]]
    refs = [hf_sampling_reference(model_dir, p, sp, eos_ids) for p, sp in zip(batch, params, strict=True)]
    plain = [
        hf_sampling_reference(model_dir, p, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0), eos_ids)
        for p in batch
    ]
    # Every adjustment changes its prompt's greedy output, so matching the reference proves something.
    assert all(r.output_ids != q.output_ids for r, q in zip(refs[1:], plain[1:], strict=True))
    outputs = engine.generate(input_ids=batch, sampling_params=[vars(p) for p in params], return_logprob=True)
    assert {o["meta_info"]["dp_rank"] for o in outputs} == {0, 1}  # both DP groups sampled some
    compared = 0
    for i, (out, ref) in enumerate(zip(outputs, refs, strict=True)):
        n = ref.compare_len
        assert out["output_ids"][:n] == ref.output_ids[:n], f"request {i}: {params[i]}"
        assert out["meta_info"]["output_token_logprobs"][:n] == pytest.approx(ref.logprobs[:n], abs=1e-4)
        compared += n
    assert compared >= 0.9 * sum(len(r.output_ids) for r in refs)
    # The stop token its plain output meets at step 3 is held off until 6 tokens were generated.
    held, stop = outputs[-1], params[-1].stop_token_ids[0]
    assert len(held["output_ids"]) >= 6 and stop not in held["output_ids"][:6]
    stopped = held["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stopped == (held["output_ids"][-1] == stop)


def test_engine_top_logprobs(engine_cache, model_dirs, prompts):
    engine = engine_for(engine_cache, model_dirs, "deepseek_v2", 2, 2)
    out = engine.generate(
        input_ids=prompts[0],
        sampling_params={"max_new_tokens": 4, "temperature": 0, "ignore_eos": True, "top_logprobs_num": 3},
        return_logprob=True,
    )
    model = _load_model(model_dirs["deepseek_v2"])
    ids = prompts[0] + out["output_ids"]
    with torch.inference_mode():
        raw = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    tops = out["meta_info"]["output_top_logprobs"]
    assert len(tops) == 4
    for j, top in enumerate(tops):
        values, expected = raw[len(prompts[0]) - 1 + j].topk(3)
        assert [t for t, _ in top] == expected.tolist()
        assert [lp for _, lp in top] == pytest.approx(values.tolist(), abs=1e-4)
        assert top[0] == (out["output_ids"][j], pytest.approx(out["meta_info"]["output_token_logprobs"][j]))
