"""Scheduler-level P/D without a model: real vLLM Schedulers with our connector, KV in CPU tensors.

A `SimEngine` is what an engine core would be if the model were replaced by a fake that
writes checkable values into the KV blocks it "computes": a real `Scheduler` (which
creates our connector's scheduler half through vLLM's factory), our real worker half
with real CPU tensors registered with a real transport, and a step loop shaped like
EngineCore's. `RemoteEngine` runs one in a child process, so bytes really cross a
process boundary over Mooncake or NIXL. `module_engine` makes either a module's fixture.

The KV value of a block is a function of the tokens it covers (and its group and layer),
so any engine can check that a block it holds — pulled, or hit in its prefix cache —
carries exactly the KV its logical position should.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import zlib
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.config import VllmConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from connectors.geometry import Geometry, GroupGeometry
from connectors.pd_connector import PDConnector
from connectors.settings import ConnectorSettings
from connectors.vllm_adapter import build_kv_cache_config
from connectors.worker import PDWorker
from pdconnect.stallwatch import start_from_environment
from pdconnect.testbed.interpreter import hold_the_interpreter_lock
from pdconnect.testbed.keys import connector_keys
from pdconnect.testbed.tinymodel import TinyModelSpec, ensure_target_and_draft
from tests.waiting import wait_until

# DeepSeek-V4-like: different block sizes per group, which no tiny CPU model gives us.
GEOMETRY = Geometry(
    (
        GroupGeometry("full_attention", 256, eagle=True),
        GroupGeometry("sliding_window", 64, 128, eagle=True),
    )
)
KV_HEADS, HEAD_DIM = 1, 8
SAMPLED_TOKEN = 7
MAX_MODEL_LEN = 16384


@cache
def _models() -> tuple[str, str]:
    target, draft = ensure_target_and_draft(TinyModelSpec(kind="hybrid-llama", max_position_embeddings=MAX_MODEL_LEN))
    return str(target), str(draft)


def _with_keys(role: str, extra: dict[str, Any]) -> dict[str, Any]:
    return {**connector_keys(role), **extra}


def engine_config(
    role: str,
    extra: dict[str, Any],
    engine_id: str,
    *,
    eagle: bool = True,
    max_num_batched_tokens: int = MAX_MODEL_LEN,
    failure_policy: str = "fail",
) -> VllmConfig:
    """A real VllmConfig as `vllm serve` would build it, with our connector configured
    (and its role's side-channel keys, unless `extra` names others)."""
    extra = _with_keys(role, extra)
    target, draft = _models()
    speculative = (
        {"method": "eagle3", "model": draft, "num_speculative_tokens": 1, "draft_load_config": {"load_format": "dummy"}}
        if eagle
        else None
    )
    return EngineArgs(
        model=target,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        enable_prefix_caching=True,
        block_size=128,
        max_num_batched_tokens=max_num_batched_tokens,
        speculative_config=speculative,
        kv_transfer_config={
            "kv_connector": "PDConnector",
            "kv_role": role,
            "engine_id": engine_id,
            "kv_connector_extra_config": extra,
            "kv_load_failure_policy": failure_policy,
        },
    ).create_engine_config()


def kv_value(tokens: list[int], group: int, layer: int, index: int, block_size: int) -> float:
    """The KV "content" of logical block `index`: a checksum of the tokens it depends on."""
    covered = array("i", tokens[: (index + 1) * block_size]).tobytes()
    return float(zlib.crc32(covered + bytes([group, layer])) % 65521)


@dataclass
class Finished:
    """What an engine reported for a finished request."""

    finish_reason: str | None
    kv_transfer_params: dict[str, Any] | None
    output_tokens: list[int]
    local_cached_tokens: int
    external_cached_tokens: int


@dataclass
class SimEngine:
    """A real Scheduler + our real worker half + CPU KV tensors, stepped by a fake model."""

    role: str
    extra: dict[str, Any]
    engine_id: str
    geometry: Geometry = GEOMETRY
    num_blocks: int = 400
    max_num_batched_tokens: int = MAX_MODEL_LEN
    failure_policy: str = "fail"
    layers_per_group: int = 2
    dp_rank: int = 0  # the data-parallel rank of an engine core of a DP server (vLLM sets it per core)
    finished: dict[str, Finished] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        init_none_hash(sha256)
        config = engine_config(
            self.role,
            self.extra,
            self.engine_id,
            max_num_batched_tokens=self.max_num_batched_tokens,
            failure_policy=self.failure_policy,
        )
        config.cache_config.num_gpu_blocks = self.num_blocks  # what profiling would have set
        config.parallel_config.data_parallel_rank = self.dp_rank
        kv_cache_config = build_kv_cache_config(self.geometry, self.num_blocks)
        for group_id, group in enumerate(kv_cache_config.kv_cache_groups):
            group.layer_names = [f"g{group_id}.layer{i}" for i in range(self.layers_per_group)]
        self.scheduler = Scheduler(
            config,
            kv_cache_config,
            StructuredOutputManager(config),
            block_size=self.geometry.scheduler_block_size,
            hash_block_size=self.geometry.hash_block_size,
            log_stats=True,
        )
        self.connector = self.scheduler.connector
        assert isinstance(self.connector, PDConnector)
        self.worker = PDWorker(
            config, kv_cache_config, ConnectorSettings.from_extra_config(_with_keys(self.role, self.extra)), tp_rank=0
        )
        self.kv_caches = {
            name: torch.zeros(self.num_blocks, KV_HEADS, group.block_size, 2 * HEAD_DIM)
            for group, spec in zip(self.geometry.groups, kv_cache_config.kv_cache_groups)
            for name in spec.layer_names
        }
        self.worker.register_kv_caches(self.kv_caches)
        handshake = self.worker.handshake_metadata()
        assert handshake is not None, "the worker registered its caches but has no handshake to publish"
        self.connector.set_xfer_handshake_metadata({0: handshake})
        self._hasher = get_request_block_hasher(self.geometry.hash_block_size, sha256)
        self._prefill: dict[str, tuple[int, int]] = {}
        self.start_free_blocks = self.free_blocks()

    # --- requests -------------------------------------------------------------------------

    def add(
        self,
        request_id: str,
        tokens: list[int],
        params: dict[str, Any] | None = None,
        max_tokens: int = 4,
        stop_token_ids: list[int] | None = None,
    ) -> None:
        extra = {"kv_transfer_params": params} if params is not None else None
        self.scheduler.add_request(
            Request(
                request_id=request_id,
                prompt_token_ids=list(tokens),
                sampling_params=SamplingParams(
                    max_tokens=max_tokens, ignore_eos=True, extra_args=extra, stop_token_ids=stop_token_ids
                ),
                pooling_params=None,
                block_hasher=self._hasher,
            )
        )

    def add_prompts(self, prompts: dict[str, list[int]], max_tokens: int = 1) -> None:
        """Add plain requests (no hand-off) all before the next step: the step then schedules
        as many of them as the token budget and the free blocks allow, at once."""
        for request_id, tokens in prompts.items():
            self.add(request_id, tokens, None, max_tokens)

    def desk_pid(self) -> int:
        """The process that answers this prefill engine's side channel."""
        producer = self.connector.scheduler_half.producer
        assert producer is not None, "not a prefill engine"
        return producer.desk.pid

    def hold_interpreter_lock(self, seconds: float, started: str | None = None) -> float:
        """Keep this engine process's interpreter lock for `seconds` in one C call, as a long
        C call in its step would; the seconds it was held. `started`: a file created just
        before, so a test knows the engine took the command (it answers once it is over)."""
        if started is not None:
            Path(started).touch()
        return hold_the_interpreter_lock(seconds)

    def abort(self, request_id: str) -> None:
        self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)

    def notify_rejected(self, request_id: str, params: dict[str, Any]) -> None:
        """What vLLM's serving layer submits after it answered a P/D request with an error
        (`AsyncLLM.notify_kv_transfer_request_rejected`), as its engine core handles it:
        a copy with prompt `[0]` and one token, added and aborted at once."""
        self.scheduler.add_request(
            Request(
                request_id=request_id,
                prompt_token_ids=[0],
                sampling_params=SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": dict(params)}),
                pooling_params=None,
                block_hasher=self._hasher,
                abort_immediately=True,
            )
        )
        self.abort(request_id)

    def add_steps_abort(
        self, request_id: str, tokens: list[int], params: dict[str, Any] | None, steps: int, max_tokens: int = 1
    ) -> None:
        """Add a request, run `steps` steps, abort it: an abort at a chosen phase."""
        self.add(request_id, tokens, params, max_tokens)
        for _ in range(steps):
            self.step()
        self.abort(request_id)

    def counter(self, name: str) -> float:
        """Total of one connector counter over this engine's life (both halves)."""
        return self.counters.get(name, 0)

    def get_finished(self, request_id: str) -> Finished | None:
        done = self.finished.get(request_id)
        return done if done is not None and done.finish_reason is not None else None

    def has_requests(self) -> bool:
        return self.scheduler.has_requests()

    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def status(self, request_id: str) -> str | None:
        request = self.scheduler.requests.get(request_id)
        return request.status.name if request is not None else None

    # --- the step loop --------------------------------------------------------------------

    def step(self) -> None:
        output = self.scheduler.schedule()
        self.worker.start(output.kv_connector_metadata)
        sampled = self._compute(output.num_scheduled_tokens)
        results = self.worker.transfer_results()
        stats = self.worker.take_stats()
        connector_output = KVConnectorOutput(
            finished_sending=results.finished_sending,
            finished_recving=results.finished_recving,
            failed_recving=results.failed_recving,
            kv_connector_stats=stats,
        )
        req_ids = list(output.num_scheduled_tokens)
        runner_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[SAMPLED_TOKEN] if sampled[r] else [] for r in req_ids],
            kv_connector_output=None if connector_output.is_empty() else connector_output,
        )
        for outputs in self.scheduler.update_from_output(output, runner_output).values():
            for out in outputs.outputs:
                self._record(out)
            stats = outputs.scheduler_stats
            if stats is not None and stats.kv_connector_stats:
                for name, value in stats.kv_connector_stats.get("counters", {}).items():
                    self.counters[name] = self.counters.get(name, 0) + value
                for name, by_reason in stats.kv_connector_stats.get("reasons", {}).items():
                    for reason, value in by_reason.items():
                        key = f"{name}[{reason}]"
                        self.counters[key] = self.counters.get(key, 0) + value

    def _compute(self, scheduled: dict[str, int]) -> dict[str, bool]:
        """Write each computed block's value; True for requests that sample this step."""
        sampled: dict[str, bool] = {}
        for request_id, count in scheduled.items():
            request = self.scheduler.requests[request_id]
            if request.prefill_stats is not None and request.prefill_stats.num_prompt_tokens:
                self._prefill.setdefault(
                    request_id,
                    (request.prefill_stats.num_local_cached_tokens, request.prefill_stats.num_external_cached_tokens),
                )
            end = request.num_computed_tokens
            self.write_blocks(request, end - count, end)
            sampled[request_id] = end >= request.num_tokens
        return sampled

    def write_blocks(self, request: Request, start: int, end: int) -> None:
        tokens = request.all_token_ids
        tables = self.scheduler.kv_cache_manager.coordinator.get_blocks(request.request_id)
        for group_id, (group, table) in enumerate(zip(self.geometry.groups, tables)):
            for index in range(start // group.block_size, -(-end // group.block_size)):
                if index < len(table) and not table[index].is_null:
                    for layer in range(self.layers_per_group):
                        value = kv_value(tokens, group_id, layer, index, group.block_size)
                        self.kv_caches[f"g{group_id}.layer{layer}"][table[index].block_id].fill_(value)

    def _record(self, out: Any) -> None:
        request_id = out.request_id
        done = self.finished.get(request_id)
        tokens = (done.output_tokens if done else []) + list(out.new_token_ids)
        if out.finish_reason is None:
            self.finished[request_id] = Finished(None, None, tokens, 0, 0) if done is None else done
            self.finished[request_id].output_tokens = tokens
            return
        local, external = self._prefill.pop(request_id, (0, 0))
        self.finished[request_id] = Finished(str(out.finish_reason), out.kv_transfer_params, tokens, local, external)

    def run_until(self, done: Callable[[], bool], timeout: float = 60.0, what: str = "the expected state") -> None:
        """Step this engine (the test's thread is its step loop) until `done()`: the
        stepping twin of `tests.waiting.wait_until`, failing the same way."""
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"waited {timeout:g} s, stepping {self.engine_id}, for {what}; "
                    f"requests in the scheduler: {sorted(self.scheduler.requests)}"
                )
            if self.scheduler.has_requests():
                self.step()
            else:
                time.sleep(0.002)

    def result(self, request_id: str, timeout: float = 60.0) -> Finished:
        self.run_until(lambda: self.get_finished(request_id) is not None, timeout, f"{request_id} to finish")
        return self.finished[request_id]

    def drain(self, timeout: float = 30.0) -> None:
        """Step until no request (finished or not) holds anything in the scheduler."""
        self.run_until(lambda: not self.has_requests(), timeout, "no request left in the scheduler")

    def block_matches(self, tokens: list[int], group_id: int, index: int, block_id: int) -> bool:
        block_size = self.geometry.groups[group_id].block_size
        return all(
            torch.all(
                self.kv_caches[f"g{group_id}.layer{layer}"][block_id]
                == kv_value(tokens, group_id, layer, index, block_size)
            ).item()
            for layer in range(self.layers_per_group)
        )

    def cached_blocks(self, tokens: list[int], group_id: int) -> dict[int, int]:
        """Logical index -> block id of `tokens`' blocks in this engine's prefix cache."""
        probe = Request("probe", list(tokens), SamplingParams(max_tokens=1), None, block_hasher=self._hasher)
        ops = self.connector.scheduler_half.ops
        block_size = self.geometry.groups[group_id].block_size
        found = {}
        for index in range(len(tokens) // block_size):
            if (block := ops.cached_block(probe, group_id, block_size, index)) is not None:
                found[index] = block.block_id
        return found

    def shutdown(self) -> None:
        self.connector.shutdown()
        self.worker.shutdown()


# --- an engine in a child process ---------------------------------------------------------


def _serve(conn: Any, kwargs: dict[str, Any]) -> None:
    start_from_environment()  # conftest turns it on: a stalled child says what its threads did
    engine = SimEngine(**kwargs)
    conn.send(("ready", engine.start_free_blocks))
    while True:
        while conn.poll():
            command, *args = conn.recv()
            if command == "stop":
                engine.shutdown()
                conn.send(("ok", None))
                return
            try:
                conn.send(("ok", getattr(engine, command)(*args)))
            except Exception as exc:  # noqa: BLE001 - any failure goes back to the test instead of killing the engine loop
                conn.send(("error", repr(exc)))
        if engine.scheduler.has_requests():
            engine.step()
        else:
            time.sleep(0.002)


class RemoteEngine:
    """A SimEngine stepping on its own in a spawned process; methods are RPCs."""

    def __init__(self, **kwargs: Any) -> None:
        context = mp.get_context("spawn")
        self._conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child, kwargs), daemon=True)
        self.process.start()
        child.close()  # so a child that dies during start-up ends recv() with EOFError
        status, self.start_free_blocks = self._conn.recv()
        assert status == "ready"

    def call(self, command: str, *args: Any, timeout: float = 60.0) -> Any:
        self._conn.send((command, *args))
        if not self._conn.poll(timeout):
            raise TimeoutError(f"remote engine did not answer {command}")
        status, value = self._conn.recv()
        if status == "error":
            raise RuntimeError(f"remote engine failed in {command}: {value}")
        return value

    def prefill(
        self, request_id: str, tokens: list[int], timeout: float = 60.0, stop_token_ids: list[int] | None = None
    ) -> Finished:
        """Run the prefill leg (max_tokens=1, do_remote_decode) and wait for its params."""
        self.call("add", request_id, tokens, {"do_remote_decode": True}, 1, stop_token_ids)
        done: Finished = wait_until(
            lambda: self.call("get_finished", request_id), f"the prefill of {request_id}", timeout
        )
        return done

    def wait_idle(self, timeout: float = 30.0) -> None:
        wait_until(lambda: not self.call("has_requests"), "the prefill engine to hold no request", timeout)

    def kill(self) -> None:
        self.process.kill()
        self.process.join()

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self.call("stop", timeout=10)
            finally:
                self.process.join(timeout=10)


def module_engine(kind: type[SimEngine | RemoteEngine], **kwargs: Any) -> Any:
    """A module-scoped fixture: a `kind` engine made with `kwargs`, shut down after the
    module (assign it to the fixture's name: `decode = module_engine(SimEngine, ...)`)."""

    @pytest.fixture(scope="module")
    def engine() -> Iterator[SimEngine | RemoteEngine]:
        started = kind(**kwargs)
        yield started
        if isinstance(started, RemoteEngine):
            started.stop()
        else:
            started.shutdown()

    return engine
