"""A decode worker's pull from several prefill ranks: one request, one outcome.

Under unequal TP one decode rank reads several prefill ranks, one transfer each. The
request is done only when every transfer is; when one fails, the worker still waits for
the others to stop writing into its blocks before it reports the failure (vLLM may hand
the blocks to another request the moment it does). The transfers are FAKE (their state
is set by the test: a real library cannot be told to fail one rank's read at a chosen
moment); the worker and its VllmConfig are real.
"""

from __future__ import annotations

from concurrent.futures import Future

from connectors.metadata import PullSpec
from connectors.settings import ConnectorSettings
from connectors.vllm_adapter import build_kv_cache_config
from connectors.worker import PDWorker, _Posted, _Pull
from pdconnect.testbed.keys import connector_keys
from pdconnect.transfer import Transfer, TransferState
from tests.pd_harness import GEOMETRY, engine_config

EXTRA = {"transport": "mooncake", "protocol": "tcp", "side_channel_port": 0}


class _ScriptedTransfer(Transfer):
    """FAKE: a transfer whose library state the test sets; it writes until `stopped`."""

    def __init__(self, description: str) -> None:
        super().__init__(description, timeout=600.0)
        self.status: tuple[TransferState, str | None] = (TransferState.PENDING, None)
        self.stopped = False

    def _status(self) -> tuple[TransferState, str | None]:
        return self.status

    def _release(self) -> bool:
        return self.stopped


def _worker() -> PDWorker:
    config = engine_config("kv_consumer", EXTRA, "decode-pulls", eagle=False)
    settings = ConnectorSettings.from_extra_config({**EXTRA, **connector_keys("kv_consumer")})
    return PDWorker(config, build_kv_cache_config(GEOMETRY, 8), settings, tp_rank=0)


def _pull(*transfers: Transfer) -> _Pull:
    posted: Future[_Posted] = Future()
    posted.set_result(_Posted(tuple(transfers), nbytes=0, ranges=0, posted=0.0))
    return _Pull(PullSpec("req-1", "prefill-0", "tcp://127.0.0.1:1", "digest"), posted)


def test_one_ranks_failed_read_waits_for_the_other_ranks_read_to_stop() -> None:
    worker = _worker()
    try:
        rank0, rank1 = _ScriptedTransfer("prefill-0/rank0"), _ScriptedTransfer("prefill-0/rank1")
        pull = _pull(rank0, rank1)
        assert worker._outcome(pull) is None  # both running

        rank0.status = (TransferState.FAILED, "peer reset")
        rank0.stopped = True
        assert worker._outcome(pull) is None  # rank 1 still writes into our blocks

        rank1.status = (TransferState.DONE, None)  # a finished read writes no more
        assert worker._outcome(pull) is False
    finally:
        worker.shutdown()


def test_a_failed_read_is_reported_only_once_it_stopped_writing() -> None:
    worker = _worker()
    try:
        rank0, rank1 = _ScriptedTransfer("prefill-0/rank0"), _ScriptedTransfer("prefill-0/rank1")
        pull = _pull(rank0, rank1)
        rank0.status = (TransferState.DONE, None)
        rank0.stopped = True
        rank1.status = (TransferState.FAILED, "timed out")
        assert worker._outcome(pull) is None  # failed, yet still writing
        rank1.stopped = True
        assert worker._outcome(pull) is False
    finally:
        worker.shutdown()
