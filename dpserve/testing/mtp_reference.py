"""A pure-torch reference of DeepSeek's MTP (NextN) draft step (GLM-4.5's is the same module around
GLM's decoder layer), built from transformers' modules.

Conventions (what an engine's NEXTN implementation must match):

* **Hidden input**: the MTP layer at row ``t`` takes ``h_t``, the main model's last hidden state at
  position ``t`` AFTER the main model's final norm (``model.norm``), i.e. transformers'
  ``last_hidden_state``. That is what transformers' own MTP candidate generator feeds (``hidden_states[-1]``,
  which ``capture_outputs`` ties to the normed ``last_hidden_state``) and what vLLM and SGLang feed (the
  target model's output hidden states, taken after ``self.norm``); DeepSeek's checkpoints were served that
  way with 85-90% acceptance. (The V3 paper's figure reads as if the pre-norm state were meant, but
  ``hnorm`` re-normalizes it either way and every serving stack uses the normed one.) For chains the hidden
  passed to the next MTP step is the MTP layer's output after ``shared_head.norm`` (transformers and SGLang).
* **Row input**: ``eh_proj(cat(enorm(embed(x_{t+1})), hnorm(h_t)))`` (embedding first, as in vLLM/SGLang).
* **Positions**: the row pairing ``h_t`` with ``x_{t+1}`` (predicting ``x_{t+2}``) has position ``t + 1``,
  the position of its token, as in transformers. Rows form their own causal sequence (the MTP layer's own
  KV cache); the first row is ``(h_0, x_1)``. RoPE is relative, so an engine that uses position ``t``
  for every row instead gets the same attention up to rounding, as long as it is consistent.
* **Output**: ``lm_head(shared_head.norm(layer(...)))``; the LM head and embedding are the main model's.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, PreTrainedModel

from dpserve.testing.tiny_models import MtpLayer


def read_mtp_tensors(model_dir: str | Path, layer: int) -> dict[str, torch.Tensor]:
    """All checkpoint tensors named ``model.layers.{layer}.*``, keys without that prefix."""
    model_dir = Path(model_dir)
    prefix = f"model.layers.{layer}."
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out = {}
    for name in files:
        with safe_open(str(model_dir / name), "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if key.startswith(prefix):
                    out[key.removeprefix(prefix)] = f.get_tensor(key)
    return out


def load_mtp_layer(model_dir: str | Path, model: PreTrainedModel) -> MtpLayer:
    """The MTP layer of a checkpoint with ``num_nextn_predict_layers >= 1``, as an :class:`MtpLayer`."""
    config = model.config
    if not getattr(config, "num_nextn_predict_layers", 0):
        raise ValueError(f"{model_dir} has no MTP layer (num_nextn_predict_layers is 0 or missing)")
    tensors = read_mtp_tensors(model_dir, config.num_hidden_layers)
    mtp = MtpLayer(config, type(model.model.layers[-1]), type(model.model.norm)).to(torch.float32)
    state = {}
    experts = config.n_routed_experts
    for name in mtp.state_dict():
        if name == "layer.mlp.experts.gate_up_proj":
            state[name] = torch.stack(
                [
                    torch.cat(
                        [
                            tensors[f"mlp.experts.{e}.gate_proj.weight"],
                            tensors[f"mlp.experts.{e}.up_proj.weight"],
                        ]
                    )
                    for e in range(experts)
                ]
            )
        elif name == "layer.mlp.experts.down_proj":
            state[name] = torch.stack([tensors[f"mlp.experts.{e}.down_proj.weight"] for e in range(experts)])
        elif name.startswith("shared_head_norm."):
            state[name] = tensors["shared_head.norm." + name.removeprefix("shared_head_norm.")]
        else:
            state[name] = tensors[name.removeprefix("layer.")]
    mtp.load_state_dict(state)
    return mtp.eval()


@functools.lru_cache(maxsize=4)
def load_reference(model_dir: str) -> tuple[PreTrainedModel, MtpLayer]:
    """transformers' main model (float32, eager attention) and the checkpoint's MTP layer."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    return model, load_mtp_layer(model_dir, model)


def mtp_layer_forward(
    model: PreTrainedModel,
    mtp: MtpLayer,
    next_ids: torch.Tensor,
    hidden: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the MTP layer over one causal sequence of rows (batch 1).

    ``next_ids [T]`` are the tokens ``x_{t+1}``, ``hidden [T, H]`` the hidden states paired with them,
    ``positions [T]`` the rows' positions. Returns ``(logits [T, V], hidden_out [T, H])`` where
    ``hidden_out`` is after ``shared_head.norm`` (what a chain passes to its next step).
    """
    emb = model.get_input_embeddings()(next_ids)[None]
    x = mtp.eh_proj(torch.cat([mtp.enorm(emb), mtp.hnorm(hidden[None])], dim=-1))
    pos = positions[None]
    position_embeddings = model.model.rotary_emb(x, pos)
    t = next_ids.shape[0]
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    x = mtp.layer(x, attention_mask=mask, position_ids=pos, position_embeddings=position_embeddings)
    out = mtp.shared_head_norm(x)[0]
    return model.get_output_embeddings()(out), out


@torch.inference_mode()
def main_hidden_states(model: PreTrainedModel, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hidden [T, H] after the final norm, logits [T, V])`` of the main model over ``token_ids``."""
    out = model.model(torch.tensor([token_ids]))
    hidden = out.last_hidden_state[0]
    return hidden, model.get_output_embeddings()(hidden)


@torch.inference_mode()
def mtp_logits(model_dir: str | Path, token_ids: list[int]) -> torch.Tensor:
    """MTP logits over a whole sequence: row ``t`` (``t = 0 .. T-2``) predicts ``token_ids[t + 2]`` from
    ``h_t`` and ``token_ids[t + 1]``; the last row predicts the token after the sequence's end."""
    model, mtp = load_reference(str(Path(model_dir).resolve()))
    hidden, _ = main_hidden_states(model, token_ids)
    ids = torch.tensor(token_ids)
    logits, _ = mtp_layer_forward(model, mtp, ids[1:], hidden[:-1], torch.arange(1, len(token_ids)))
    return logits


@torch.inference_mode()
def mtp_accuracy(model_dir: str | Path, sequences: list[list[int]]) -> float:
    """Fraction of rows whose MTP argmax equals the true token two ahead (teacher-forced)."""
    hits = total = 0
    for seq in sequences:
        pred = mtp_logits(model_dir, seq)[:-1].argmax(-1)  # rows 0..T-3 have a true target
        hits += int((pred == torch.tensor(seq[2:])).sum())
        total += len(seq) - 2
    return hits / max(total, 1)


@dataclass
class MtpDrafts:
    """Greedy generation with what the MTP head drafts at each step."""

    output_ids: list[int]  # greedy tokens of the main model
    # draft_ids[j]: the MTP's greedy guess for output_ids[j + 1], made from output_ids[j] and the main
    # model's hidden state at the position that produced output_ids[j] (the last one guesses past the end)
    draft_ids: list[int]

    @property
    def accept_rate(self) -> float:
        """Fraction of drafts that equal the next greedy token (a 1-step NEXTN's acceptance)."""
        pairs = list(zip(self.draft_ids[:-1], self.output_ids[1:], strict=True))
        return sum(d == o for d, o in pairs) / max(len(pairs), 1)


@torch.inference_mode()
def mtp_greedy_drafts(model_dir: str | Path, prompt_ids: list[int], max_new_tokens: int) -> MtpDrafts:
    """Greedy-decode ``prompt_ids`` with the main model (no cache, full recompute per step) and return the
    MTP's 1-step draft at every step, computed over the whole sequence as the engine's MTP KV would hold
    it (rows for the prompt included)."""
    model, _ = load_reference(str(Path(model_dir).resolve()))
    tokens = list(prompt_ids)
    for _ in range(max_new_tokens):
        _, logits = main_hidden_states(model, tokens)
        tokens.append(int(logits[-1].argmax()))
    logits = mtp_logits(model_dir, tokens)  # row t predicts tokens[t + 2]
    n = len(prompt_ids)
    # output j sits at position n + j; its draft is row n + j - 1 (paired h_{n+j-1}, x_{n+j}).
    drafts = logits[n - 1 :].argmax(-1).tolist()
    return MtpDrafts(tokens[n:], drafts)


@torch.inference_mode()
def mtp_draft_chain(model_dir: str | Path, token_ids: list[int], num_steps: int) -> list[int]:
    """A greedy NEXTN chain after ``token_ids`` (its last token is the one just emitted by the target):
    step 1 pairs the main hidden state of the second-to-last position with the last token; step ``s > 1``
    appends a row pairing the previous step's MTP hidden (after ``shared_head.norm``) with its draft, at
    the next position. Returns ``num_steps`` draft tokens."""
    model, mtp = load_reference(str(Path(model_dir).resolve()))
    hidden, _ = main_hidden_states(model, token_ids)
    ids = list(token_ids[1:])
    rows_hidden = hidden[:-1]
    drafts: list[int] = []
    for _ in range(num_steps):
        positions = torch.arange(1, len(ids) + 1)
        logits, out = mtp_layer_forward(model, mtp, torch.tensor(ids), rows_hidden, positions)
        draft = int(logits[-1].argmax())
        drafts.append(draft)
        ids.append(draft)
        rows_hidden = torch.cat([rows_hidden, out[-1:]])
    return drafts
