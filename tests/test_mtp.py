"""MTP (NextN) test checkpoints, the pure-torch MTP reference, and the trained tiny DeepSeek-V3."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from dpserve.testing.mtp_reference import (
    load_reference,
    mtp_accuracy,
    mtp_draft_chain,
    mtp_greedy_drafts,
    mtp_logits,
    read_mtp_tensors,
)
from dpserve.testing.tiny_models import write_tiny_model


def _tensors(model_dir):
    index = model_dir / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.exists()
        else ["model.safetensors"]
    )
    out = {}
    for name in files:
        with safe_open(str(model_dir / name), "pt") as f:
            out |= {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118
    return out


@pytest.fixture(scope="module")
def mtp_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    return (
        write_tiny_model("deepseek_v3", root / "plain"),
        write_tiny_model("deepseek_v3_mtp", root / "mtp"),
        write_tiny_model("deepseek_v3", root / "sharded", mtp=True, shard_size="100KB"),
    )


def test_mtp_checkpoint_layout(mtp_dirs):
    plain, mtp, sharded = mtp_dirs
    config = json.loads((mtp / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    n, hidden = config["num_hidden_layers"], config["hidden_size"]
    main, with_mtp = _tensors(plain), _tensors(mtp)
    # the main model is the same one (same seed); only model.layers.{n}.* was added
    extra = set(with_mtp) - set(main)
    assert set(main) <= set(with_mtp) and all(k.startswith(f"model.layers.{n}.") for k in extra)
    assert all(torch.equal(main[k], with_mtp[k]) for k in main)
    p = f"model.layers.{n}."
    assert with_mtp[p + "enorm.weight"].shape == (hidden,) and with_mtp[p + "hnorm.weight"].shape == (hidden,)
    assert with_mtp[p + "eh_proj.weight"].shape == (hidden, 2 * hidden)
    assert with_mtp[p + "shared_head.norm.weight"].shape == (hidden,)
    assert torch.equal(with_mtp[p + "embed_tokens.weight"], main["model.embed_tokens.weight"])
    assert torch.equal(with_mtp[p + "shared_head.head.weight"], main["lm_head.weight"])
    # a full MoE decoder layer with the same tensor names (and shapes) as the main model's MoE layer 1
    layer1 = {
        k.removeprefix("model.layers.1."): v.shape for k, v in main.items() if k.startswith("model.layers.1.")
    }
    mtp_layer = {k.removeprefix(p): v.shape for k, v in with_mtp.items() if k.startswith(p)}
    assert all(mtp_layer.get(k) == shape for k, shape in layer1.items()), set(layer1) - set(mtp_layer)
    assert set(mtp_layer) - set(layer1) == {
        "enorm.weight",
        "hnorm.weight",
        "eh_proj.weight",
        "shared_head.norm.weight",
        "embed_tokens.weight",
        "shared_head.head.weight",
    }
    # sharded: the same MTP layer in its own shard, listed in the index
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert {index["weight_map"][k] for k in extra} == {"model-mtp.safetensors"}
    assert all(torch.equal(a, read_mtp_tensors(sharded, n)[k]) for k, a in read_mtp_tensors(mtp, n).items())


def test_transformers_loads_main_model(mtp_dirs):
    plain, mtp, _ = mtp_dirs
    ids = torch.tensor([[5, 17, 42, 8, 99, 3]])
    logits = []
    for path in (plain, mtp):
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        with torch.no_grad():
            logits.append(model(ids).logits)
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)


def test_mtp_reference_is_causal_and_consistent(mtp_dirs):
    _, mtp, sharded = mtp_dirs
    tokens = [5, 17, 42, 8, 99, 3, 250, 11, 64]
    full = mtp_logits(mtp, tokens)
    assert full.shape == (len(tokens) - 1, 301)
    # rows only see earlier rows: a prefix gives the same logits
    torch.testing.assert_close(mtp_logits(mtp, tokens[:5]), full[:4], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mtp_logits(sharded, tokens), full, rtol=0, atol=0)
    model, layer = load_reference(str(mtp.resolve()))
    drafts = mtp_greedy_drafts(mtp, tokens, 6)
    assert len(drafts.output_ids) == len(drafts.draft_ids) == 6
    chain = mtp_draft_chain(mtp, tokens + drafts.output_ids[:1], 3)
    assert chain[0] == drafts.draft_ids[0]
    assert 0.0 <= mtp_accuracy(mtp, [tokens]) <= 1.0
    assert layer.layer.mlp.__class__.__name__ == "DeepseekV3MoE"
    del model


def test_trained_mtp_model():
    """The trained tiny DeepSeek-V3 (cached; the first build trains it, about 1-2 minutes on 2 free cores)."""
    from dpserve.testing.trained_mtp import FIRST_TOKEN, synthetic_sequences, trained_mtp_model

    path = trained_mtp_model()
    info = json.loads((path / "training.json").read_text())
    assert json.loads((path / "config.json").read_text())["num_nextn_predict_layers"] == 1
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()  # main model loads
    held_out = synthetic_sequences(8, 64, seed=777)
    accuracy = mtp_accuracy(path, held_out)
    assert accuracy > 0.6, (accuracy, info)
    # greedy generation continues the synthetic text and is not one repeated token
    prompt = held_out[0][:20]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16)[0, 20:].tolist()
    assert len(set(out)) > 4 and all(t >= FIRST_TOKEN for t in out), out
    drafts = mtp_greedy_drafts(path, prompt, 16)
    assert drafts.output_ids == out
    assert drafts.accept_rate > 0.5, drafts
