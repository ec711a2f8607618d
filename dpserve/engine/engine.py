"""The offline Engine: starts one process per rank and talks to the group leaders over ZMQ."""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing as mp
import shutil
import socket
import tempfile
import uuid
from pathlib import Path

import zmq

from dpserve.config import EngineConfig
from dpserve.distributed import Topology
from dpserve.engine.worker import WorkerAddresses, run_worker
from dpserve.models.config import ModelConfig
from dpserve.sampling_params import SamplingParams
from dpserve.scheduler.request import GenerateRequest, check_request_fits

logger = logging.getLogger("dpserve")

POLL_MS = 100


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerFailure(RuntimeError):
    """A rank died or raised; the engine is shut down."""


class Engine:
    """DP-attention inference engine (design section 6).

    Engine(model_path=..., tp_size=4, dp_size=2, enable_dp_attention=True, device="cpu",
           dtype="float32", random_seed=0, max_total_tokens=..., ...)
    """

    def __init__(self, model_path: str | None = None, **kwargs):
        self._closed = True  # until the workers start
        self.cfg = EngineConfig(model_path=model_path, **kwargs)
        self.model_cfg = ModelConfig.load(self.cfg.model_path)
        self.model_cfg.validate(Topology(self.cfg.tp_size, self.cfg.dp_size, 0))
        self.tokenizer = _load_tokenizer(self.cfg.model_path)
        self._dir = Path(tempfile.mkdtemp(prefix="dpserve-"))
        self._zmq = zmq.Context()
        self._outputs = self._zmq.socket(zmq.PULL)
        self._outputs.bind(f"ipc://{self._dir}/out")
        self._requests = []
        for g in range(self.cfg.dp_size):
            sock = self._zmq.socket(zmq.PUSH)
            sock.bind(f"ipc://{self._dir}/req{g}")
            self._requests.append(sock)
        addrs = WorkerAddresses(
            dist_init=self.cfg.dist_init_addr or f"127.0.0.1:{free_port()}",
            requests=[f"ipc://{self._dir}/req{g}" for g in range(self.cfg.dp_size)],
            outputs=f"ipc://{self._dir}/out",
        )
        spawn = mp.get_context("spawn")
        self._procs = [
            spawn.Process(target=run_worker, args=(r, self.cfg, addrs), daemon=True, name=f"dpserve-rank{r}")
            for r in range(self.cfg.tp_size)
        ]
        self._next_group = itertools.count()
        self._results: dict[str, dict] = {}
        self._step_logs: dict[int, list] = {}
        for p in self._procs:
            p.start()
        self._closed = False
        self._ready: dict[int, dict] = {}
        try:
            while len(self._ready) < self.cfg.tp_size:
                self._receive()
        except BaseException:
            self.shutdown()
            raise
        self.dp_info = [self._ready[g * self.cfg.attn_tp_size] for g in range(self.cfg.dp_size)]
        per_group = self.dp_info[0]["max_total_num_tokens"]
        logger.info(
            "ready: %s tp=%d dp=%d attention TP=%d; KV %d tokens per DP group (%d bytes/token), "
            "%d for the instance; prefill budget %d tokens per group, %d global",
            self.model_cfg.arch,
            self.cfg.tp_size,
            self.cfg.dp_size,
            self.cfg.attn_tp_size,
            per_group,
            self.dp_info[0]["kv_bytes_per_token"],
            per_group * self.cfg.dp_size,
            self.cfg.chunked_prefill_size,
            self.cfg.chunked_prefill_size * self.cfg.dp_size,
        )

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
        groups = [next(self._next_group) % self.cfg.dp_size for _ in ids]
        for i, (x, p, g) in enumerate(zip(ids, params, groups, strict=True)):
            try:
                self._check_fits(x, p, g)
            except ValueError as e:
                raise ValueError(f"request {i}: {e}") from None
        rids = [self._submit(x, p, return_logprob, g) for x, p, g in zip(ids, params, groups, strict=True)]
        results = [self.wait(rid) for rid in rids]
        return results[0] if single else results

    def submit(
        self,
        input_ids: list[int],
        sampling_params: dict | None = None,
        return_logprob: bool = False,
        dp_rank: int | None = None,
    ) -> str:
        """Queues one request without waiting; returns its id for `wait`."""
        params = SamplingParams.from_dict(sampling_params)
        group = next(self._next_group) % self.cfg.dp_size if dp_rank is None else dp_rank
        if not 0 <= group < self.cfg.dp_size:
            raise ValueError(f"dp_rank={dp_rank} is outside [0, {self.cfg.dp_size})")
        self._check_fits(input_ids, params, group)
        return self._submit(list(input_ids), params, return_logprob, group)

    def wait(self, rid: str) -> dict:
        """Blocks until request `rid` finishes; raises ValueError if it was rejected."""
        while rid not in self._results:
            self._receive()
        o = self._results.pop(rid)
        if o["finish_reason"]["type"] == "abort":
            raise ValueError(o["finish_reason"]["message"])
        text = self.tokenizer.decode(o["output_ids"], skip_special_tokens=True) if self.tokenizer else ""
        meta = {k: o[k] for k in ("prompt_tokens", "completion_tokens", "finish_reason", "dp_rank")}
        if o["return_logprob"]:
            meta["output_token_logprobs"] = o["output_token_logprobs"]
        return {"text": text, "output_ids": o["output_ids"], "meta_info": meta}

    def get_server_info(self) -> dict:
        return {
            "tp_size": self.cfg.tp_size,
            "dp_size": self.cfg.dp_size,
            "attn_tp_size": self.cfg.attn_tp_size,
            "dp_ranks": [
                {
                    "dp_rank": g,
                    "max_total_num_tokens": info["max_total_num_tokens"],
                    "kv_bytes_per_token": info["kv_bytes_per_token"],
                }
                for g, info in enumerate(self.dp_info)
            ],
        }

    def get_step_log(self) -> list[list]:
        """Per DP group, the StepRecords of the steps run since the last call (then cleared)."""
        for sock in self._requests:
            sock.send_pyobj({"type": "get_step_log"})
        while len(self._step_logs) < self.cfg.dp_size:
            self._receive()
        logs, self._step_logs = self._step_logs, {}
        return [logs[g] for g in range(self.cfg.dp_size)]

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for sock in self._requests:
            with contextlib.suppress(zmq.Again):  # a leader that is gone is killed below
                sock.send_pyobj({"type": "shutdown"}, flags=zmq.NOBLOCK)
        for p in self._procs:
            p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join()
        self._zmq.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.shutdown()

    # --- internals --------------------------------------------------------------------------

    def _send(self, group: int, msg: object) -> None:
        if self._closed:
            raise RuntimeError("the engine is shut down")
        self._requests[group].send_pyobj(msg)

    def _check_fits(self, input_ids: list[int], params: SamplingParams, group: int) -> None:
        capacity = self.dp_info[group]["max_total_num_tokens"]
        check_request_fits(len(input_ids), params, self.model_cfg.context_len, capacity)

    def _submit(self, input_ids: list[int], params: SamplingParams, return_logprob: bool, group: int) -> str:
        rid = uuid.uuid4().hex
        self._send(group, GenerateRequest(rid, input_ids, params, return_logprob))
        return rid

    def _dead_ranks(self) -> list[str]:
        return [
            f"worker rank {i} exited with code {p.exitcode}" for i, p in enumerate(self._procs) if p.exitcode
        ]

    def _fail(self, reported: str) -> None:
        # A rank killed from outside reports nothing; its peers then fail in a collective.
        # Name the dead ranks first: they are the cause.
        cause = "; ".join(filter(None, [*self._dead_ranks(), reported]))
        self.shutdown()
        logger.error("shutting down: %s", cause)
        raise WorkerFailure(cause)

    def _receive(self) -> None:
        """Takes one message from the workers; raises WorkerFailure if a rank failed or died."""
        if self._closed:
            raise RuntimeError("the engine is shut down")
        while not self._outputs.poll(POLL_MS):
            if self._dead_ranks() and not self._outputs.poll(POLL_MS):
                self._fail("")
        msg = self._outputs.recv_pyobj()
        if msg["type"] == "error":
            self._fail(f"worker rank {msg['rank']} failed: {msg['error']}\n{msg['traceback']}")
        if msg["type"] == "ready":
            self._ready[msg["rank"]] = msg
        elif msg["type"] == "step_log":
            self._step_logs[msg["dp_rank"]] = msg["steps"]
        else:
            self._results[msg["rid"]] = msg


def _load_tokenizer(model_path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError):
        logger.warning("no tokenizer found in %s; only input_ids prompts are accepted", model_path)
        return None
