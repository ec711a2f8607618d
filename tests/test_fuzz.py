"""The HTTP API fuzzed as a hostile client would: schemathesis against a running tp=1 server on a
tiny checkpoint, every operation of its OpenAPI document, every check (positive_data_acceptance
excepted: a request the schema allows may still be refused for the prompt plus max_tokens
exceeding the context or the KV pool, which no JSON Schema can say). No 5xx, every response as
the document says (status, content type, body schema), schema-violating requests refused; the
server alive afterwards with no KV held. The longer run: docs/operations.md."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
from schemathesis.config import SchemathesisWarning

from dpserve.testing.server import ServerProcess

FUZZ_SECONDS = 12  # schemathesis' time budget; docs/operations.md has the longer run
# Every warning but validation_mismatch ("an operation mostly rejected generated data"): chat
# requests carry grammars (json_schema, regex, ebnf, response_format's schema, tools' parameters),
# whose validity (a schema, pattern or grammar xgrammar can parse) no JSON Schema can state; the
# server refuses most random ones with a 400 naming the fault, which the checks still verify.
WARNINGS = ",".join(w.value for w in SchemathesisWarning if w is not SchemathesisWarning.VALIDATION_MISMATCH)


def kv_used(url: str) -> float:
    lines = httpx.get(f"{url}/metrics").text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("dpserve_kv_used_tokens"))


def test_fuzzed_api_never_fails_and_matches_its_schema(model_dirs, engine_cache, tmp_path):
    engine_cache.close()  # two cores: no idle engine beside the server
    # A small pool: the longest generations a schema-valid request may ask for stay short.
    with ServerProcess("--model-path", model_dirs["llama"], "--tp", "1", "--max-total-tokens", "256") as srv:
        run = subprocess.run(
            [sys.executable, "-m", "schemathesis.cli", "run", f"{srv.url}/openapi.json"]
            + ["--checks", "all", "--exclude-checks", "positive_data_acceptance"]
            + ["--phases", "coverage,fuzzing", "--max-examples", "15", "--max-time", str(FUZZ_SECONDS)]
            + ["--seed", "1", "--workers", "1", "--request-timeout", "60", "--no-shrink"]
            + ["--generation-database", "none", "--warnings", WARNINGS],
            capture_output=True,
            text=True,
            cwd=tmp_path,  # schemathesis keeps a .schemathesis folder in its working directory
            timeout=FUZZ_SECONDS + 120,
        )
        summary = run.stdout[-6000:]
        assert run.returncode == 0, summary
        assert "No issues found" in summary and " passed" in summary, summary
        assert httpx.get(f"{srv.url}/health").text == "ok"
        dump = httpx.post(f"{srv.url}/dump_expert_load")  # a dense model: no expert load to give
        assert dump.status_code == 400
        assert (
            dump.json()["error"]["message"]
            == "LlamaForCausalLM has no routed experts: there is no expert load"
        )
        deadline = time.monotonic() + 30
        while kv_used(srv.url) > 0:  # aborted requests' KV is freed by the scheduler's next step
            assert time.monotonic() < deadline, "KV still held after the fuzz run"
        assert "Traceback" not in srv.output, srv.output[-4000:]
