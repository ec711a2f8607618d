"""A tiny DeepSeek-V3 trained on the CPU, with a trained MTP (NextN) head, for speculative-decoding tests.

The text is synthetic with learnable structure: concatenated arithmetic progressions modulo ``MODULUS``
(start, step and length drawn at random per segment), so after two tokens of a segment both the next and
the next-next token are determined; only segment starts are unpredictable. The main LM loss and the MTP
loss (token ``t+2`` from the normed hidden state ``h_t`` and ``embed(x_{t+1})``, the conventions of
:mod:`dpserve.testing.mtp_reference`) are trained together. The checkpoint (tokenizer of
:mod:`dpserve.testing.tiny_models`, synthetic tokens are ids ``FIRST_TOKEN ..``) is cached under
``$DPSERVE_CACHE`` (default ``~/.cache/dpserve``) keyed by a hash of the settings::

    python -m dpserve.testing.trained_mtp            # build (once) and print the directory and figures
    python -m dpserve.testing.trained_mtp --num-layers 6   # the deeper variant of the NEXTN benchmark
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, GenerationConfig

from dpserve.cache import cache_root
from dpserve.testing.tiny_models import (
    _DEEPSEEK_V3,
    _ROPE_DEFAULT,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    MtpLayer,
    add_mtp_layer,
    build_tokenizer,
    mtp_layer_state_dict,
)

logger = logging.getLogger(__name__)

FIRST_TOKEN = len(SPECIAL_TOKENS)  # synthetic value v is token id FIRST_TOKEN + v
MODULUS = 50
STEPS = (1, 2, 3, 5, 7, -1, -2, -3)
SEGMENT_LEN = (8, 24)

# The tiny DeepseekV3 of tiny_models, smaller, with plain RoPE and an MTP layer.
MODEL = _DEEPSEEK_V3 | dict(
    num_hidden_layers=2,
    n_group=2,
    topk_group=1,
    rope_parameters=_ROPE_DEFAULT,
    initializer_range=0.05,
    num_mtp_layers=1,
)
TRAIN = dict(steps=300, batch=16, seq_len=64, lr=3e-3, mtp_weight=1.0, seed=0, threads=2)
_VERSION = 1  # bump when the training code changes in a way the settings do not capture


def synthetic_sequences(n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` token sequences of ``length`` tokens of the synthetic text (held-out data: another seed)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        seq: list[int] = []
        while len(seq) < length:
            start, step = rng.randrange(MODULUS), rng.choice(STEPS)
            seq += [FIRST_TOKEN + (start + i * step) % MODULUS for i in range(rng.randint(*SEGMENT_LEN))]
        out.append(seq[:length])
    return out


def _settings(num_layers: int) -> dict:
    model = MODEL | {"num_hidden_layers": num_layers}
    return {"model": model, "train": TRAIN, "data": [MODULUS, STEPS, SEGMENT_LEN], "version": _VERSION}


def trained_mtp_model(cache_dir: str | Path | None = None, num_layers: int = 2) -> Path:
    """The trained checkpoint's directory, training it first (1-3 minutes on 2 CPU threads with the
    default 2 decoder layers; the benchmarks' deeper variants, whose MTP layer is a smaller share of the
    model as in DeepSeek-V3's 61 + 1, take longer) if not cached.

    ``cache_dir`` defaults to ``$DPSERVE_CACHE`` or ``~/.cache/dpserve``. ``training.json`` in the
    directory records the training time and held-out accuracies.
    """
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    settings = _settings(num_layers)
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    target = root / f"trained-mtp-deepseek-v3-{digest}"
    if (target / "training.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{target.name}.lock", "w") as lock:  # concurrent callers wait for one training
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "training.json").exists():
            return target
        if target.exists():
            shutil.rmtree(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=root))
        try:
            _train_and_save(tmp, settings)
            tmp.rename(target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def _mtp_forward(model: DeepseekV3ForCausalLM, mtp: MtpLayer, ids: torch.Tensor, hidden: torch.Tensor):
    """Batched MTP logits: row ``t`` pairs ``hidden[:, t]`` with ``ids[:, t + 1]`` at position ``t + 1``."""
    next_ids = ids[:, 1:]
    h = hidden[:, :-1]
    batch, t = next_ids.shape
    x = mtp.eh_proj(torch.cat([mtp.enorm(model.model.embed_tokens(next_ids)), mtp.hnorm(h)], dim=-1))
    pos = torch.arange(1, t + 1)[None].expand(batch, -1)
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    x = mtp.layer(
        x, attention_mask=mask, position_ids=pos, position_embeddings=model.model.rotary_emb(x, pos)
    )
    return model.lm_head(mtp.shared_head_norm(x))


def _train_and_save(out: Path, settings: dict) -> None:
    cfg = TRAIN
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg["threads"])
    try:
        torch.manual_seed(cfg["seed"])
        config = DeepseekV3Config(
            **settings["model"], vocab_size=VOCAB_SIZE, bos_token_id=0, eos_token_id=1, pad_token_id=2
        )
        config._attn_implementation = "eager"
        model = DeepseekV3ForCausalLM(config).float().train()
        mtp = MtpLayer(config).float().train()
        with torch.no_grad():
            for name, p in mtp.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, config.initializer_range)
        params = list(model.parameters()) + list(mtp.parameters())
        opt = torch.optim.AdamW(params, lr=cfg["lr"], weight_decay=0.0)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, cfg["lr"], total_steps=cfg["steps"], pct_start=0.1)
        data = torch.tensor(synthetic_sequences(cfg["steps"] * cfg["batch"], cfg["seq_len"], cfg["seed"]))
        ce = torch.nn.functional.cross_entropy
        start = time.perf_counter()
        for step in range(cfg["steps"]):
            ids = data[step * cfg["batch"] : (step + 1) * cfg["batch"]]
            hidden = model.model(ids).last_hidden_state  # after the final norm: the MTP's hidden input
            logits = model.lm_head(hidden)
            main_loss = ce(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
            mtp_logits = _mtp_forward(model, mtp, ids, hidden)  # row t predicts ids[:, t + 2]
            mtp_loss = ce(mtp_logits[:, :-1].flatten(0, 1), ids[:, 2:].flatten())
            loss = main_loss + cfg["mtp_weight"] * mtp_loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            if step % 50 == 0 or step == cfg["steps"] - 1:
                logger.info(
                    "step %d: main loss %.3f, mtp loss %.3f (%.0f s)",
                    step,
                    main_loss.item(),
                    mtp_loss.item(),
                    time.perf_counter() - start,
                )
        train_s = time.perf_counter() - start
        model.eval()
        model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=1, pad_token_id=2)
        model.save_pretrained(str(out))
        build_tokenizer(out)
        add_mtp_layer(out, mtp_layer_state_dict(model, 0.0, torch.Generator(), mtp=mtp.eval()))
        figures = evaluate(out)
    finally:
        torch.set_num_threads(threads)
    info = {
        "train_seconds": round(train_s, 1),
        "final_loss": [round(main_loss.item(), 4), round(mtp_loss.item(), 4)],
        **figures,
    }
    info["settings"] = settings
    (out / "training.json").write_text(json.dumps(info, indent=2) + "\n")


@torch.inference_mode()
def evaluate(model_dir: str | Path, n: int = 16, length: int = 64, seed: int = 12345) -> dict[str, float]:
    """Held-out teacher-forced accuracies of a checkpoint: main next-token and MTP next-next-token."""
    from dpserve.testing.mtp_reference import load_reference, main_hidden_states, mtp_accuracy

    sequences = synthetic_sequences(n, length, seed)
    model, _ = load_reference(str(Path(model_dir).resolve()))
    hits = total = 0
    for seq in sequences:
        _, logits = main_hidden_states(model, seq)
        hits += int((logits[:-1].argmax(-1) == torch.tensor(seq[1:])).sum())
        total += len(seq) - 1
    return {
        "main_accuracy": round(hits / total, 4),
        "mtp_accuracy": round(mtp_accuracy(model_dir, sequences), 4),
    }


def main() -> None:
    """Command-line entry point: build (or find) the cached checkpoint and print where and how good."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m dpserve.testing.trained_mtp", description=main.__doc__)
    p.add_argument("--num-layers", type=int, default=2, help="decoder layers of the main model")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path = trained_mtp_model(num_layers=args.num_layers)
    print(path)
    print((path / "training.json").read_text())


if __name__ == "__main__":
    main()
