"""The offline Engine: the front end driven synchronously from Python."""

from __future__ import annotations

import contextlib
import logging

from dpserve.config import EngineConfig
from dpserve.engine.front_end import FrontEnd, RequestState
from dpserve.engine.worker_pool import WorkerFailure
from dpserve.messages import Abort
from dpserve.sampling_params import SamplingParams

__all__ = ["Engine", "WorkerFailure"]

logger = logging.getLogger("dpserve")


class Engine:
    """DP-attention inference engine (docs/design.md, section 6); keywords are EngineConfig's fields.

    Engine(model_path=..., tp_size=4, dp_size=2, enable_dp_attention=True, device="cpu",
           dtype="float32", random_seed=0, max_total_tokens=..., ...)
    """

    def __init__(self, model_path: str | None = None, **kwargs):
        cfg = EngineConfig(model_path=model_path, **kwargs)
        if cfg.nnodes > 1:
            raise ValueError("the offline Engine runs on one node; use launch_server for nnodes > 1")
        self.front = FrontEnd(cfg)
        self.cfg, self.model_cfg = self.front.cfg, self.front.model_cfg
        self.tokenizer = _load_tokenizer(self.cfg.model_path)
        self._params: dict[str, SamplingParams] = {}  # requests not waited for yet: how to decode them

    # --- public API -------------------------------------------------------------------------

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
    ) -> dict | list[dict]:
        """Generates for one prompt (returns a dict) or a batch (returns a list of dicts)."""
        if (prompt is None) == (input_ids is None):
            raise ValueError("pass exactly one of prompt or input_ids")
        single = isinstance(prompt, str) or (
            input_ids is not None and input_ids and isinstance(input_ids[0], int)
        )
        if prompt is not None:
            if self.tokenizer is None:
                raise ValueError(f"no tokenizer in {self.cfg.model_path}; pass input_ids instead")
            prompts = [prompt] if single else list(prompt)
            ids = [self.tokenizer.encode(p) for p in prompts]
        else:
            ids = [list(input_ids)] if single else [list(x) for x in input_ids]
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(ids):
                raise ValueError(f"{len(sampling_params)} sampling_params for {len(ids)} prompts")
            params = [SamplingParams.from_dict(p) for p in sampling_params]
        else:
            params = [SamplingParams.from_dict(sampling_params)] * len(ids)
        for i, (x, p) in enumerate(zip(ids, params, strict=True)):
            try:
                self.front.check(x, p)
            except ValueError as e:
                raise ValueError(f"request {i}: {e}") from None
        rids = [self._send(x, p, return_logprob) for x, p in zip(ids, params, strict=True)]
        results, error = [], None
        for i, rid in enumerate(rids):
            try:
                results.append(self.wait(rid))
            except ValueError as e:  # the others are aborted and still waited for: none is left behind
                if error is None:
                    error = ValueError(f"request {i}: {e}")
                    for other in rids[i + 1 :]:
                        self.front.abort(other)
        if error is not None:
            raise error
        return results[0] if single else results

    def submit(
        self,
        input_ids: list[int],
        sampling_params: dict | None = None,
        return_logprob: bool = False,
        dp_rank: int | None = None,
    ) -> str:
        """Queues one request without waiting (routed as the server routes, or to `dp_rank`);
        returns its id for `wait`. Raises ValueError for a request that can never run."""
        input_ids, params = list(input_ids), SamplingParams.from_dict(sampling_params)
        self.front.check(input_ids, params, dp_rank)
        return self._send(input_ids, params, return_logprob, dp_rank)

    def _send(
        self, input_ids: list[int], params: SamplingParams, return_logprob: bool, dp_rank: int | None = None
    ) -> str:
        """Sends a request `front.check` passed."""
        rid = self.front.send(input_ids, params, return_logprob, dp_rank).rid
        self._params[rid] = params
        return rid

    def wait(self, rid: str) -> dict:
        """Blocks until request `rid` finishes; raises ValueError if it was rejected."""
        state = self.front.requests[rid]
        while state.output is None:
            self.front.apply(self.front.recv())
        self.front.release(rid)
        return self._result(state, self._params.pop(rid))

    def get_server_info(self) -> dict:
        return self.front.server_info()

    def get_metrics(self) -> list[dict]:
        """Per DP rank, the latest load and cache figures its leader reported (the scheduler's
        `stats()`: running, queued, KV used/free/cached, tokens prefilled and generated, cache
        hits and evictions, retractions) and the router's load."""
        return self.front.metrics()["dp_ranks"]

    def get_step_log(self) -> list[list]:
        """Per DP group, the StepRecords of the steps run since the last call (then cleared)."""
        return self.front.get_step_logs()

    def get_expert_load(self) -> list[list[int]]:
        """Rows routed to each expert of each MoE layer (the MTP layer's last) since the last call:
        the input a redundant-expert placement needs."""
        return self.front.get_expert_load()

    def shutdown(self) -> None:
        if hasattr(self, "front"):
            self.front.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self) -> None:
        # At interpreter exit the modules shutdown needs may be gone; the ranks die with us anyway.
        with contextlib.suppress(Exception):
            self.shutdown()

    def _result(self, state: RequestState, params: SamplingParams) -> dict:
        o = state.output
        if isinstance(o.finish_reason, Abort):
            raise ValueError(o.finish_reason.message)
        text = ""
        if self.tokenizer is not None:
            text = self.tokenizer.decode(
                o.output_ids,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
            )
        meta = o.meta_info()
        if o.return_logprob:
            meta["output_token_logprobs"] = o.output_token_logprobs
            if params.top_logprobs_num:
                meta["output_top_logprobs"] = o.output_top_logprobs
        return {"text": text, "output_ids": o.output_ids, "meta_info": meta}


def _load_tokenizer(model_path: str):
    from dpserve.models.tokenizer import load_tokenizer

    try:
        return load_tokenizer(model_path)
    except (OSError, ValueError):
        logger.warning("no tokenizer found in %s; only input_ids prompts are accepted", model_path)
        return None
