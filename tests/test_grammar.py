"""Structured output (dpserve/grammar.py): grammars checked where requests enter, compiled on each
group's leader, followed by one matcher per request; a random-weight model, whose free output is
noise, writes JSON that follows every schema of a varied set, strings its regex matches, and the
same greedy tokens in every layout."""

from __future__ import annotations

import json
import re
import shutil

import jsonschema
import pytest
from conftest import engine_for

from dpserve.grammar import GrammarCache, Matcher, check_grammar, token_bitmask
from dpserve.sampling_params import SamplingParams

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 999},
                    "admin": {"type": "boolean"},
                },
                "required": ["id", "admin"],
            },
            "note": {"type": "string", "maxLength": 6},
        },
        "required": ["user", "note"],
    },
    "bounded array": {
        "type": "array",
        "items": {"type": "integer", "minimum": -5, "maximum": 5},
        "minItems": 2,
        "maxItems": 4,
    },
    "enum": {"enum": ["red", "green", 3, None]},
    "pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}},
        "required": ["code"],
    },
    "anyOf": {
        "anyOf": [
            {"type": "boolean"},
            {
                "type": "object",
                "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["n"],
            },
        ]
    },
    "$ref": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": 0, "maximum": 99},
                    "y": {"type": "integer", "minimum": 0, "maximum": 99},
                },
                "required": ["x", "y"],
            }
        },
        "type": "array",
        "items": {"$ref": "#/$defs/point"},
        "minItems": 1,
        "maxItems": 2,
    },
}
REGEX = r"[0-9]{3}-[a-z]{2,4}( [A-Z])?"
EBNF = 'root ::= "yes" | "no" | "maybe " [0-9]'
PROMPTS = ["hello world", "the cat sat", "1 2 3", "a"]


# --- checks where a request enters ---------------------------------------------------------------


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"json_schema": "{not json"}, "json_schema is not valid JSON"),
        ({"json_schema": '{"type": "wat"}'}, 'invalid json_schema: Unsupported type "wat"'),
        ({"json_schema": '{"$ref": "#/$defs/missing"}'}, "invalid json_schema: "),
        (
            {"regex": "a(b"},
            "invalid regex: Regex parsing error at position 4: The parenthesis is not closed.",
        ),
        ({"ebnf": "root ::= foo"}, 'invalid ebnf: EBNF parser error at line 1, column 10: Rule "foo" is not'),
        ({"regex": "a", "ebnf": 'root ::= "a"'}, "at most one of json_schema, regex and ebnf"),
    ],
)
def test_invalid_grammars_are_refused_naming_the_fault(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_grammar(SamplingParams(**fields), "xgrammar")


def test_grammar_fields_are_strings_and_need_a_backend():
    with pytest.raises(ValueError, match="json_schema must be a string"):
        SamplingParams.from_dict({"json_schema": {"type": "object"}})
    params = SamplingParams.from_dict({"regex": "[ab]+"})
    check_grammar(params, "xgrammar")
    with pytest.raises(
        ValueError, match="regex needs a grammar backend: this server runs with --grammar-backend none"
    ):
        check_grammar(params, "none")
    check_grammar(SamplingParams(), "none")  # no grammar: nothing to refuse


def test_a_verify_steps_rows_follow_the_drafts_and_the_matcher_ends_where_it_began():
    """Rows after a draft hold what the matcher allows once the draft is accepted; a refused draft
    leaves the rows after it all-allowed; filling accepts nothing for good."""
    import xgrammar as xgr

    vocab = ["a", "b", "c", "</s>"]
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[3])
    compiled = xgr.GrammarCompiler(info).compile_regex("ab?c")
    a, b, c, eos = range(4)

    def allowed(bitmask, row):
        return [t for t in range(4) if bitmask[row, 0] >> t & 1]

    m = Matcher(compiled, [eos])
    bitmask = token_bitmask(4, 4)
    m.fill(bitmask, 0, [a, b, c])
    assert [allowed(bitmask, r) for r in range(4)] == [[a], [b, c], [c], [eos]]
    bitmask = token_bitmask(3, 4)
    m.fill(bitmask, 0, [c, a])  # c is refused at the start: the row after it allows everything
    assert [allowed(bitmask, r) for r in range(3)] == [[a], [a, b, c, eos], [a, b, c, eos]]
    assert m.accept(a) and not m.accept(a) and m.accept(c) and not m.terminated and m.accept(eos)
    assert m.terminated
    ended = Matcher(compiled, [])  # no stop token: the grammar's last token ends it
    assert ended.accept(a) and ended.accept(c) and ended.terminated


def test_a_token_the_grammar_refuses_ends_its_request_before_it_with_a_grammar_error(model_dirs):
    """Should a sampled token ever break the grammar (its mask allowed it: a grammar engine's
    fault), the request ends with its own error, 422 "grammar_error", not a server error; its output
    stops before that token, its KV is freed, and the request beside it goes on to its end."""
    from test_scheduler import assert_slots_consistent
    from transformers import AutoTokenizer

    from dpserve.messages import GenerateRequest
    from dpserve.scheduler.scheduler import Scheduler
    from dpserve.server.admission import error_body
    from dpserve.server.streams import aborted_error

    tokenizer = AutoTokenizer.from_pretrained(model_dirs["llama"])
    (digit,), (letter,) = (tokenizer.encode(c, add_special_tokens=False) for c in "7a")
    grammars = GrammarCache(model_dirs["llama"], 301, (tokenizer.eos_token_id,), capacity=4, max_whitespace=0)
    s = Scheduler(0, 64, 4, 16, 100, 301, eos_ids=(tokenizer.eos_token_id,), seed=0, grammars=grammars)
    for rid in ("bad", "good"):
        assert (
            s.add(
                GenerateRequest(
                    rid, [5, 6, 7], SamplingParams(regex="[0-9]{4}", temperature=0.0, max_new_tokens=8)
                )
            )
            is None
        )
    grammars.get(("regex", "[0-9]{4}")).result()
    scheduled = s.schedule()
    assert len(scheduled.batch.reqs) == 2
    assert s.process_samples(scheduled, [[digit], [digit]], [[0.0], [0.0]]) == (
        [("bad", digit, 0.0, []), ("good", digit, 0.0, [])],
        [],
    )
    new, (bad,) = s.process_samples(s.schedule(), [[letter], [digit]], [[0.0], [0.0]])
    assert new == [("good", digit, 0.0, [])] and bad.rid == "bad" and bad.output_ids == [digit]
    message = f"the grammar refused token {letter} at output position 1; the output ends before it"
    assert bad.finish_reason.wire() == {"type": "abort", "message": message, "status_code": 422}
    error = aborted_error(bad.finish_reason.wire())
    assert error_body(error.status, str(error))["error"] == {
        "message": f"the request was aborted: {message}",
        "type": "grammar_error",
        "code": 422,
    }
    assert_slots_consistent(s)
    for tok in (digit, digit, tokenizer.eos_token_id):  # the grammar's end, then its stop token
        finished = s.process_samples(s.schedule(), [[tok]], [[0.0]])[1]
    assert finished[0].output_ids == [digit] * 4 + [tokenizer.eos_token_id]
    assert finished[0].finish_reason.wire() == {"type": "stop", "matched": tokenizer.eos_token_id}
    assert not s.running and s.kv.allocator.num_free + s.kv.tree.size == 64
    grammars.close()


# --- through the engine ----------------------------------------------------------------------------


def _generate(engine, prompts, **params) -> list[dict]:
    return engine.generate(prompt=prompts, sampling_params={"max_new_tokens": 96, **params})


@pytest.fixture(scope="module")
def compact(engine_cache, model_dirs):
    """The tiny Llama, JSON written without free whitespace."""
    return engine_for(engine_cache, model_dirs, "llama", 1, 1, grammar_max_whitespace=0)


@pytest.mark.parametrize("name", SCHEMAS)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_random_weights_write_json_that_follows_the_schema(compact, name, temperature):
    schema = SCHEMAS[name]
    outs = _generate(compact, PROMPTS, json_schema=json.dumps(schema), temperature=temperature, seed=5)
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        jsonschema.validate(json.loads(out["text"]), schema)


def test_regex_and_ebnf_outputs_match_and_free_output_does_not(compact):
    for out in _generate(compact, PROMPTS, regex=REGEX, temperature=1.0, seed=2):
        assert re.fullmatch(REGEX, out["text"]), out["text"]
    texts = [o["text"] for o in _generate(compact, PROMPTS, ebnf=EBNF, temperature=1.0, seed=2)]
    assert all(t in ("yes", "no") or re.fullmatch("maybe [0-9]", t) for t in texts), texts
    free = _generate(compact, PROMPTS, temperature=0.0, max_new_tokens=16)
    assert not any(re.fullmatch(REGEX, o["text"]) for o in free)  # the grammar did the work


def test_a_grammar_unfinished_at_max_tokens_ends_with_length(compact):
    (out,) = _generate(compact, ["x"], regex="[a-z]{50}", max_new_tokens=5, temperature=0.0)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert re.fullmatch("[a-z]+", out["text"]) and len(out["output_ids"]) == 5


def test_ignore_eos_ends_when_the_grammar_does(compact):
    (out,) = _generate(compact, ["x"], ebnf='root ::= "done"', ignore_eos=True, temperature=0.0)
    assert out["text"] == "done" and out["meta_info"]["finish_reason"]["type"] == "stop"


def test_invalid_grammar_fails_before_queueing_and_others_are_served(compact):
    with pytest.raises(ValueError, match="invalid regex"):
        _generate(compact, ["x"], regex="(")
    (out,) = _generate(compact, ["x"], regex="[0-9]{4}", temperature=0.0)
    assert re.fullmatch("[0-9]{4}", out["text"])
    (before,) = compact.get_metrics()
    _generate(compact, ["y"], regex="[0-9]{4}", temperature=0.0)  # the same text: compiled once
    (after,) = compact.get_metrics()
    assert after["grammar_compiles"] == before["grammar_compiles"] >= 1
    assert after["grammar_cache_hits"] == before["grammar_cache_hits"] + 1


def _greedy_grammar_outputs(engine) -> list[list[int]]:
    outs = []
    for params in [*({"json_schema": json.dumps(s)} for s in SCHEMAS.values()), {"regex": REGEX}]:
        outs += [o["output_ids"] for o in _generate(engine, PROMPTS, temperature=0.0, **params)]
    return outs


def test_speculative_drafts_are_accepted_only_as_far_as_the_grammar_allows(engine_cache, model_dirs, compact):
    """NGRAM drafts verified under the mask (rows filled as the drafts leave the matcher, which
    rolls them back): the same greedy outputs as without speculation, and drafts were accepted."""
    plain = _greedy_grammar_outputs(compact)
    spec = engine_for(
        engine_cache,
        model_dirs,
        "llama",
        1,
        1,
        grammar_max_whitespace=0,
        speculative_algorithm="NGRAM",
        speculative_num_steps=3,
    )
    assert _greedy_grammar_outputs(spec) == plain
    for schema in SCHEMAS.values():  # sampled: drafts checked by rejection sampling, masked rows
        for out in _generate(spec, PROMPTS, json_schema=json.dumps(schema), temperature=1.0, seed=7):
            jsonschema.validate(json.loads(out["text"]), schema)
    (m,) = spec.get_metrics()
    assert m["spec_draft_tokens"] > 0 and m["spec_accepted_tokens"] > 0


BOUNDED = {  # bounded strings inside bounded arrays: the shapes that escaped their mask (issue 48)
    "tags": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 8},
                "minItems": 2,
                "maxItems": 3,
            }
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    "bounded array": SCHEMAS["bounded array"],
    "nested": SCHEMAS["nested"],
}
FILTERS = [  # every sampled path's filters and logit changes, cycled over the seeds
    {},
    {"top_k": 20, "top_p": 0.9},
    {"min_p": 0.05, "frequency_penalty": 0.8},
    {"presence_penalty": 1.0, "repetition_penalty": 1.2, "logit_bias": {"25": 3.0, "67": -2.0}},
]


@pytest.mark.parametrize("speculation", ["NGRAM", None])
def test_every_sampled_token_is_one_its_grammar_allowed(engine_cache, model_dirs, speculation):
    """48 seeds at temperature 1.0 per schema, with top-k/top-p/min-p, penalties and logit_bias, and
    with NGRAM drafts verified by rejection sampling: each output replayed through a fresh matcher
    accepts every token in turn and ends the grammar, and no request ends in an error."""
    spec = dict(speculative_algorithm="NGRAM", speculative_num_steps=3) if speculation else {}
    engine = engine_for(engine_cache, model_dirs, "llama", 1, 1, grammar_max_whitespace=0, **spec)
    grammars = GrammarCache(model_dirs["llama"], 301, (1,), capacity=4, max_whitespace=0)
    for schema in BOUNDED.values():
        text = json.dumps(schema)
        params = [
            {"json_schema": text, "temperature": 1.0, "seed": seed, "max_new_tokens": 96, **FILTERS[seed % 4]}
            for seed in range(48)
        ]
        compiled = grammars.get(("json_schema", text)).result()
        for out in engine.generate(prompt=[PROMPTS[s % 4] for s in range(48)], sampling_params=params):
            assert out["meta_info"]["finish_reason"]["type"] == "stop", out["meta_info"]["finish_reason"]
            matcher = Matcher(compiled, [1])
            for i, tok in enumerate(out["output_ids"]):
                assert matcher.accept(tok), (schema, out["output_ids"], i)
            assert matcher.terminated
            jsonschema.validate(json.loads(out["text"]), schema)
    grammars.close()


@pytest.fixture(scope="module")
def byte_fallback_model(model_dirs, tmp_path_factory) -> str:
    """The tiny Llama with a SentencePiece-style tokenizer of the same 301 ids: byte-fallback
    tokens <0x00>..<0xFF> for whatever its pieces do not cover, single characters and merged
    pieces ("the", "▁th"), "▁" for spaces."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    out = tmp_path_factory.mktemp("byte_fallback") / "llama"
    shutil.copytree(model_dirs["llama"], out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).unlink()
    special = ["<|bos|>", "<|eos|>", "<|pad|>"]
    pieces = [*special, *(f"<0x{b:02X}>" for b in range(256)), *'▁aeotnsrilh{}":,[]0123456789']
    merges = [("t", "h"), ("h", "e"), ("i", "n"), ("e", "r"), ("a", "n"), ("r", "e"), ("o", "n")]
    merges += [("a", "t"), ("▁", "t"), ("▁", "a"), ("▁t", "h"), ("▁th", "e"), ("e", "s"), ("s", "t")]
    pieces += [a + b for a, b in merges]
    tok = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=merges, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(special)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=special[0], eos_token=special[1], pad_token=special[2]
    )
    assert len(fast) == len(pieces) == 301 and len(fast.encode("é", add_special_tokens=False)) > 1
    fast.save_pretrained(str(out))
    return str(out)


def test_a_byte_fallback_tokenizer_writes_valid_json_and_non_ascii_patterns(
    engine_cache, byte_fallback_model
):
    """Characters outside the pieces come as UTF-8 byte tokens, which the grammar must follow
    byte by byte: valid JSON for every schema, and a pattern of non-ASCII letters matched."""
    engine = engine_cache.get(byte_fallback_model, grammar_max_whitespace=0)
    for schema in SCHEMAS.values():
        for out in _generate(engine, PROMPTS, json_schema=json.dumps(schema), temperature=1.0, seed=4):
            jsonschema.validate(json.loads(out["text"]), schema)
    accented = {"type": "string", "pattern": "^[éüß]{2,4}$"}
    for out in _generate(engine, PROMPTS, json_schema=json.dumps(accented), temperature=1.0, seed=4):
        assert re.fullmatch("[éüß]{2,4}", json.loads(out["text"])), out["text"]


# --- every layout ----------------------------------------------------------------------------------

LAYOUT_REQUESTS = [
    dict(json_schema=json.dumps(SCHEMAS["nested"])),
    dict(json_schema=json.dumps(SCHEMAS["$ref"])),
    dict(regex=REGEX),
    dict(ebnf=EBNF),
    dict(),  # unconstrained, in the same batch
]


def _layout_outputs(engine) -> list[list[int]]:
    outs = []
    for params in LAYOUT_REQUESTS:  # each grammar over every prompt, one batch each
        outs += [o["output_ids"] for o in _generate(engine, PROMPTS, temperature=0.0, **params)]
    (alone,) = _generate(engine, ["a"], temperature=0.0, **LAYOUT_REQUESTS[0])  # other groups idle
    return [*outs, alone["output_ids"]]


@pytest.fixture(scope="module")
def one_rank_outputs(engine_cache, model_dirs):
    return _layout_outputs(engine_for(engine_cache, model_dirs, "deepseek_v2", 1, 1))


@pytest.mark.parametrize("tp,dp", [(2, 2)])  # masks apply on each group's leader, whatever the TP
def test_greedy_constrained_outputs_are_the_same_in_every_layout(
    engine_cache, model_dirs, one_rank_outputs, tp, dp
):
    outs = _layout_outputs(engine_for(engine_cache, model_dirs, "deepseek_v2", tp, dp))
    assert outs == one_rank_outputs


def test_whitespace_is_bounded_by_default(engine_cache, model_dirs, one_rank_outputs):
    """The default engine (16 whitespace characters in a row at most) on the nested schema."""
    engine = engine_for(engine_cache, model_dirs, "deepseek_v2", 4, 2)
    outs = _generate(engine, PROMPTS, temperature=1.0, seed=9, json_schema=json.dumps(SCHEMAS["nested"]))
    runs = [len(r) for o in outs for r in re.findall(r"\s+", o["text"])]
    assert runs and max(runs) <= 16
    for out in outs:
        if out["meta_info"]["finish_reason"]["type"] == "stop":
            jsonschema.validate(json.loads(out["text"]), SCHEMAS["nested"])


# --- composed with the engine's features ---------------------------------------------------------


@pytest.mark.parametrize(
    "name,kwargs",
    [
        ("max_len padding", dict(dp_padding_mode="max_len")),
        # sum_len beside chunks and retraction: one engine fewer (the suite's time)
        (
            "sum_len padding, chunked prefill and retraction",
            dict(dp_padding_mode="sum_len", max_total_tokens=128, chunked_prefill_size=4),
        ),
    ],
)
def test_constrained_outputs_compose_with_padding_chunks_retraction_and_the_cache(
    engine_cache, model_dirs, one_rank_outputs, name, kwargs
):
    """tp 2 dp 2: the same greedy outputs as one rank, with each padding mode, and with prompts
    prefilled in chunks of 2 into a pool of 128 tokens, too small for the batch (requests retracted and resumed,
    their matchers kept); run twice, the second time from the prefix cache."""
    engine = engine_for(engine_cache, model_dirs, "deepseek_v2", 2, 2, **kwargs)
    assert _layout_outputs(engine) == one_rank_outputs
    hits = sum(m["cache_hit_tokens"] for m in engine.get_metrics())
    assert _layout_outputs(engine) == one_rank_outputs
    metrics = engine.get_metrics()
    assert sum(m["cache_hit_tokens"] for m in metrics) > hits
    if "retraction" in name:
        assert sum(m["retractions"] for m in metrics) > 0


def test_nextn_drafts_follow_the_grammar(engine_cache):
    """NEXTN on the trained tiny DeepSeek-V3: constrained greedy outputs equal those without
    speculation, and MTP drafts are accepted under the grammar."""
    from dpserve.testing.trained_mtp import trained_mtp_model

    path = str(trained_mtp_model())
    prompts = [[5, 9, 14, 3, 8], [20, 21, 22], [7] * 6]
    requests = [dict(regex="[ab ]{4,12}[.]"), dict(json_schema=json.dumps(SCHEMAS["bounded array"])), {}]

    def outputs(engine):
        return [
            o["output_ids"]
            for params in requests
            for o in engine.generate(
                input_ids=prompts, sampling_params={"max_new_tokens": 40, "temperature": 0, **params}
            )
        ]

    plain = outputs(engine_cache.get(path))
    spec = engine_cache.get(path, speculative_algorithm="NEXTN", speculative_num_steps=2)
    assert outputs(spec) == plain
    assert sum(m["spec_accepted_tokens"] for m in spec.get_metrics()) > 0


def test_the_grammar_benchmark_walks_the_schema(model_dirs):
    """dpserve.bench.grammar on the tiny Llama: every figure measured, a cache hit far below a compile."""
    from dpserve.bench.grammar import measure

    result = measure(model_dirs["llama"], json.dumps(SCHEMAS["nested"]), steps=50, rows=4, seed=0)
    assert all(v > 0 for k, v in result.items() if k != "compile_cached_ms")
    assert result["compile_cached_ms"] < result["compile_cold_ms"]
    assert result["fill_median_us"] <= result["fill_p99_us"]
