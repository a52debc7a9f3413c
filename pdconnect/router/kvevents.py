"""Subscriptions to each engine's vLLM KV events, feeding one `kvindex.EngineKVIndex` per engine.

One asyncio task per engine: a ZMQ SUB socket on the engine's event endpoint reading
`(topic, seq, payload)` frames as vLLM's `ZmqEventPublisher` sends them. Sequence
numbers must follow each other; on a gap (a restart, a dropped message at the high-water
mark) the task asks the engine's replay socket (ROUTER, `replay_endpoint` in vLLM's
`--kv-events-config`) for everything from the first missing batch. Without a replay
socket, or when replay fails, the engine's index is dropped and rebuilt from what comes
next; until an index has seen a batch the engine counts as *not fresh* and the kv-aware
policy routes by prefix affinity for it.

Failures never reach a request: every error in a task is caught, logged and counted
(`pdconnect_router_kv_events{result=...}`), and the task reconnects after a pause.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import msgspec
import zmq
import zmq.asyncio

from pdconnect.router.kvindex import EngineKVIndex, decode_batch

__all__ = ["KVEventsFeed", "events_endpoint"]

logger = logging.getLogger("pdconnect.router.kvevents")

_END_SEQ = (-1).to_bytes(8, "big", signed=True)
_REPLAY_TIMEOUT_MS = 2000
_RECONNECT_PAUSE = 1.0


def events_endpoint(engine_url: str, port: int) -> str:
    """`tcp://<engine host>:<port>`: engines publish on their own address."""
    host = urlsplit(engine_url).hostname or "127.0.0.1"
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


@dataclass
class _Subscription:
    url: str
    endpoint: str
    replay_endpoint: str | None
    index: EngineKVIndex = field(default_factory=EngineKVIndex)
    last_seq: int | None = None
    fresh: bool = False
    task: asyncio.Task[None] | None = None


class KVEventsFeed:
    """Indexes of every watched engine, kept current by one subscriber task each."""

    def __init__(
        self,
        endpoints: Callable[[str], tuple[str, str | None] | None],
        count: Callable[[str], None] = lambda result: None,
    ) -> None:
        """`endpoints(engine_url)` -> (events endpoint, replay endpoint or None), or None
        for an engine that publishes nothing; `count(result)` hears of every batch
        ("ok"), gap, replay and error."""
        self._endpoints = endpoints
        self._count = count
        self._context = zmq.asyncio.Context()
        self._subs: dict[str, _Subscription] = {}

    def watch(self, url: str) -> None:
        if url in self._subs:
            return
        where = self._endpoints(url)
        if where is None:
            return
        sub = self._subs[url] = _Subscription(url, *where)
        sub.task = asyncio.get_running_loop().create_task(self._run(sub))

    def forget(self, url: str) -> None:
        sub = self._subs.pop(url, None)
        if sub is not None and sub.task is not None:
            sub.task.cancel()

    def hit_tokens(self, url: str, tokens: Sequence[int], keys: dict[int, list[int]] | None = None) -> int | None:
        """Prefix tokens the engine caches for `tokens`; None while its index is not fresh.
        Pass the same `keys` dict for every engine of one request: chain keys are computed once."""
        sub = self._subs.get(url)
        if sub is None or not sub.fresh:
            return None
        return sub.index.hit_tokens(tokens, keys)

    def index(self, url: str) -> EngineKVIndex | None:
        """The engine's index, or None while it is not fresh (the same rule as `hit_tokens`)."""
        sub = self._subs.get(url)
        return sub.index if sub is not None and sub.fresh else None

    async def close(self) -> None:
        tasks = [s.task for s in self._subs.values() if s.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._subs.clear()
        self._context.destroy(linger=0)

    # --- one engine ----------------------------------------------------------------------------

    async def _run(self, sub: _Subscription) -> None:
        while True:
            socket = self._context.socket(zmq.SUB)
            try:
                socket.setsockopt(zmq.SUBSCRIBE, b"")
                socket.connect(sub.endpoint)
                while True:
                    frames = await socket.recv_multipart()
                    await self._receive(sub, frames)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a helper task: never let it die silently
                self._count("error")
                logger.warning("kv events from %s (%s): %r; reconnecting", sub.url, sub.endpoint, exc)
                self._reset(sub)
                await asyncio.sleep(_RECONNECT_PAUSE)
            finally:
                socket.close(linger=0)

    async def _receive(self, sub: _Subscription, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self._count("malformed")
            return
        _, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        if sub.last_seq is None and seq > 0:
            # Joined late: what the engine cached before is in its replay buffer.
            await self._replay(sub, 0)
        if sub.last_seq is not None and seq > sub.last_seq + 1:
            self._count("gap")
            logger.info("kv events from %s: gap %d..%d", sub.url, sub.last_seq + 1, seq - 1)
            if not await self._replay(sub, sub.last_seq + 1):
                self._reset(sub)
        if sub.last_seq is not None and seq <= sub.last_seq:
            if seq < sub.last_seq - 1:  # numbering restarted: the engine restarted
                self._reset(sub)
            else:
                return  # already applied (replayed)
        self._apply(sub, seq, payload)

    def _apply(self, sub: _Subscription, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._count("malformed")
            logger.warning("kv events from %s: undecodable batch %d: %s", sub.url, seq, exc)
            return
        sub.index.apply(batch)
        sub.last_seq = seq
        sub.fresh = True
        self._count("ok")

    async def _replay(self, sub: _Subscription, start: int) -> bool:
        """Apply the batches from `start` on from the engine's replay buffer; False if none."""
        if sub.replay_endpoint is None:
            return False
        socket = self._context.socket(zmq.DEALER)
        try:
            socket.connect(sub.replay_endpoint)
            await socket.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await socket.poll(_REPLAY_TIMEOUT_MS):
                    self._count("replay_timeout")
                    return False
                frames = await socket.recv_multipart()
                if len(frames) != 4:
                    continue
                _, _, seq_bytes, payload = frames
                if seq_bytes == _END_SEQ:
                    self._count("replay")
                    return sub.last_seq is not None and sub.last_seq >= start
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if sub.last_seq is None or seq > sub.last_seq:
                    self._apply(sub, seq, payload)
        finally:
            socket.close(linger=0)

    def _reset(self, sub: _Subscription) -> None:
        sub.index = EngineKVIndex()
        sub.last_seq = None
        sub.fresh = False
