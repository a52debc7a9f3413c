"""Subscriptions to each engine's vLLM KV events, feeding one `kvindex.EngineKVIndex` per engine.

An engine here is what `engines.Engine` is: a server, or one data-parallel rank of one.
vLLM gives each rank of a data-parallel server a publisher of its own, its ports offset
by the rank (`ZmqEventPublisher.offset_endpoint_port`), and stamps each batch with the
rank (`data_parallel_rank`): the feed subscribes to every rank's stream, keys each index
by the engine's name (`<url>#dp<rank>`), and an index applies only its own rank's batches.

One asyncio task per engine: a ZMQ SUB socket on the engine's event endpoint reading
`(topic, seq, payload)` frames as vLLM's `ZmqEventPublisher` sends them. Sequence
numbers must follow each other. The engine keeps its last batches in a replay buffer
(vLLM's `buffer_steps`, 10 000 by default) behind a ROUTER socket (`replay_endpoint` in
`--kv-events-config`): a request of one start sequence number is answered with every
buffered batch from it on, then an end marker. The task asks it as soon as it has
subscribed (a router that starts late, or reconnects, learns what the engine cached
before, even from an engine that publishes nothing more), and again from the first
missing batch on every gap in the live stream (a restart, a message dropped at the
high-water mark).

A replay can itself arrive with gaps: vLLM sends the whole answer at once, its ROUTER
queues ZMQ's default 1000 messages per peer and silently drops the rest, so a reply of
thousands of batches loses most of them. A gap inside a reply therefore ends that round
and the task asks again from the batch after the last one it applied (a fresh socket: the
rest of the old reply is dropped with it); so does a reply that stops without its end
marker (dropped too) for `_REPLAY_TAIL_MS`. Each round applies at least the first
batches the ROUTER queued, so a buffer of 10 000 takes about ten rounds; a round that
applies nothing ends the replay.

An engine's next batch shows any gap before it, but an idle engine sends none: a replay
that timed out, or live batches dropped after the last one heard (vLLM's PUB queues
`hwm` messages per subscriber, then drops), would wait for traffic. So a replay that
applied anything or did not answer to its end leaves the subscription *unsettled*, and
so does every live batch: after `_SETTLE_MS` without a live batch the task asks again
from its last batch, until a replay answers with nothing new. An engine publishing
steadily is never asked; one that stops costs one short reply (the end marker alone)
per subscriber. The work is bounded: `_REPLAY_DEADLINE` for a whole replay, and each
batch is received by an await that yields the loop (pyzmq's asyncio sockets do on every
message), so requests are routed between any two replayed batches.

Whenever batches are lost for good (no replay socket, a replay that fails or starts later
than asked, an unreadable batch), the engine's index is dropped and rebuilt from the next
batch on: an index built from a suffix of the stream is safe, since a removal of a block
it never saw is a no-op. Until an index has applied a batch, or a replay has answered to
its end, the engine counts as *not fresh* and the kv-aware policy routes by prefix
affinity for it.

Bounded input: every frame over `max_message_bytes` makes ZMQ drop the connection
(`ZMQ_MAXMSGSIZE`, on the SUB and the replay socket alike; the SUB reconnects and the gap
is replayed or the index rebuilt), and each socket queues at most `_QUEUED_MESSAGES`
messages, so a subscription's buffers stay under their product. Frames of the wrong
shape are counted and dropped; events are checked one by one by the index.

Failures never reach a request: every error in a task is caught, logged and counted
(`pdconnect_router_kv_events{result=...}`; invalid events by reason in
`pdconnect_router_kv_events_invalid`), and the task reconnects after a pause.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import zmq
import zmq.asyncio

from pdconnect.router.engines import engine_name
from pdconnect.router.kvindex import DEFAULT_MAX_BLOCKS, EngineKVIndex
from pdconnect.router.prompt import RoutingPrompt

__all__ = ["DEFAULT_MAX_MESSAGE_BYTES", "KVEventsFeed", "events_endpoint", "offset_port"]

logger = logging.getLogger("pdconnect.router.kvevents")

_END_SEQ = (-1).to_bytes(8, "big", signed=True)
_REPLAY_TIMEOUT_MS = 2000  # for the first batch of a reply
# Between two batches of a reply: longer, and its tail (end marker included) was dropped,
# so the round ends and the next asks from the batch after the last one applied.
_REPLAY_TAIL_MS = 250
_REPLAY_DEADLINE = 30.0  # for a whole replay (all its rounds), however chatty the engine is
_RECONNECT_PAUSE = 1.0
# Quiet time on an unsettled subscription before the task asks the replay whether the
# engine published more than it heard (module docstring).
_SETTLE_MS = 1000
# A store event for a 128k-token prompt is under 1 MB; a batch holds one scheduler step's.
DEFAULT_MAX_MESSAGE_BYTES = 8 << 20
_QUEUED_MESSAGES = 64  # per socket (ZMQ_RCVHWM): 64 x the message cap at the very worst


def events_endpoint(engine_url: str, port: int) -> str:
    """`tcp://<engine host>:<port>`: engines publish on their own address."""
    host = urlsplit(engine_url).hostname or "127.0.0.1"
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def offset_port(endpoint: str, dp_rank: int) -> str:
    """`endpoint` with its port moved up by `dp_rank`: where vLLM binds a data-parallel rank's
    publisher (`offset_endpoint_port`; a port of 0, or an endpoint with none, stays as it is)."""
    base, sep, port = endpoint.rpartition(":")
    if not dp_rank or not sep or not port.isdigit() or int(port) == 0:
        return endpoint
    return f"{base}:{int(port) + dp_rank}"


def _seq(frame: bytes) -> int | None:
    """A frame's sequence number; None unless it is 8 bytes holding a number >= 0."""
    if len(frame) != 8:
        return None
    seq = int.from_bytes(frame, "big", signed=True)
    return seq if seq >= 0 else None


@dataclass
class _Subscription:
    name: str  # `engines.engine_name`: the URL, and the rank of a data-parallel one
    endpoint: str
    replay_endpoint: str | None
    dp_rank: int | None = None
    index: EngineKVIndex = field(default_factory=EngineKVIndex)
    last_seq: int | None = None
    replayed: range = range(0)  # sequence numbers the last replay applied (their live copies are late)
    fresh: bool = False
    # Checked against the replay buffer since the last live batch: the last replay answered to
    # its end with nothing new (or there is no replay socket). Unsettled, a quiet stream is
    # followed by another replay.
    settled: bool = True
    task: asyncio.Task[None] | None = None


class KVEventsFeed:
    """Indexes of every watched engine, kept current by one subscriber task each."""

    def __init__(
        self,
        endpoints: Callable[[str, int | None], tuple[str, str | None] | None],
        count: Callable[[str], None] = lambda result: None,
        invalid: Callable[[str], None] = lambda reason: None,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        """`endpoints(engine_url, dp_rank)` -> (events endpoint, replay endpoint or None) of
        the engine (of its rank `dp_rank`, None: no data parallelism), or None for an engine
        that publishes nothing; `count(result)` hears of every batch
        ("ok"), gap, replay and error; `invalid(reason)` of every event or frame dropped.
        `max_blocks` bounds each engine's index (all its groups), `max_message_bytes` each frame."""
        self._endpoints = endpoints
        self._count = count
        self._invalid = invalid
        self._max_blocks = max_blocks
        self._max_message_bytes = max_message_bytes
        self._context = zmq.asyncio.Context()
        self._subs: dict[str, _Subscription] = {}
        # Tasks of forgotten engines, cancelled but maybe not yet finished: `close` waits for
        # them too, so none closes its sockets after the context is gone.
        self._leaving: set[asyncio.Task[None]] = set()

    def watch(self, url: str, dp_rank: int | None = None) -> None:
        """Subscribe to the engine at `url` (its rank `dp_rank`); its index is then read
        under `engines.engine_name(url, dp_rank)`."""
        name = engine_name(url, dp_rank)
        if name in self._subs:
            return
        where = self._endpoints(url, dp_rank)
        if where is None:
            return
        sub = self._subs[name] = _Subscription(name, *where, dp_rank=dp_rank)
        sub.index = self._new_index(sub)
        sub.task = asyncio.get_running_loop().create_task(self._run(sub))

    def forget(self, name: str) -> None:
        sub = self._subs.pop(name, None)
        if sub is not None and sub.task is not None:
            sub.task.cancel()
            self._leaving.add(sub.task)
            sub.task.add_done_callback(self._leaving.discard)

    def hit_tokens(self, name: str, prompt: RoutingPrompt, *, eagle_groups: Collection[int] = ()) -> int | None:
        """Prefix tokens the engine named `name` caches for the prompt; None while its index is not fresh.
        Pass the same prompt for every engine of one request: chain keys are computed once.
        `eagle_groups`: see `EngineKVIndex.hit_tokens` (an engine drafting with EAGLE/MTP)."""
        sub = self._subs.get(name)
        if sub is None or not sub.fresh:
            return None
        return sub.index.hit_tokens(prompt, eagle_groups=eagle_groups)

    async def fill_keys(self, prompt: RoutingPrompt) -> None:
        """Compute the prompt's chain keys at every granularity the watched engines key
        blocks at (`EngineKVIndex.granularity`: each engine's finest block size) on the
        loop's default executor: the part of a lookup that scales with the prompt. What
        stays on the loop for `hit_tokens` on each engine and the decider
        (`lookup.predicted_hits`) is then one dict lookup per block up to each engine's hit
        (`make bench-lookup`). The lookups themselves stay on the loop: it is the loop that
        applies events to the indexes they read."""
        sizes = {s.index.granularity for s in list(self._subs.values()) if s.fresh} - {0}
        if sizes:
            await asyncio.get_running_loop().run_in_executor(None, prompt.fill, sizes)

    def applied_sequences(self) -> dict[str, int]:
        """Per engine name, the sequence number of the last batch its index took in (none
        for an engine whose index is still empty): what `/metrics` exports, so a watcher
        can tell that the router has seen an engine's batches up to one it saw published."""
        return {url: s.last_seq for url, s in list(self._subs.items()) if s.last_seq is not None}

    def index(self, name: str) -> EngineKVIndex | None:
        """The engine's index, or None while it is not fresh (the same rule as `hit_tokens`)."""
        sub = self._subs.get(name)
        return sub.index if sub is not None and sub.fresh else None

    async def close(self) -> None:
        tasks = [s.task for s in self._subs.values() if s.task is not None] + list(self._leaving)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._subs.clear()
        self._context.destroy(linger=0)

    # --- one engine ----------------------------------------------------------------------------

    def _new_index(self, sub: _Subscription) -> EngineKVIndex:
        return EngineKVIndex(max_blocks=self._max_blocks, count=self._invalid, engine=sub.name, dp_rank=sub.dp_rank)

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        socket = self._context.socket(kind)
        socket.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
        socket.setsockopt(zmq.RCVHWM, _QUEUED_MESSAGES)
        return socket

    async def _run(self, sub: _Subscription) -> None:
        while True:
            socket = self._socket(zmq.SUB)
            # ZMQ drops a connection that sent a frame over the cap and does not reconnect
            # by itself: the monitor hears of it, and the whole socket starts over.
            monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            poller = zmq.asyncio.Poller()
            poller.register(socket, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            try:
                socket.setsockopt(zmq.SUBSCRIBE, b"")
                socket.connect(sub.endpoint)
                # Subscribed (or reconnected, index reset): what the engine published before is
                # in its replay buffer. Live batches meanwhile queue on the SUB socket; those the
                # replay applied are skipped, and a gap after it is replayed again.
                await self._replay(sub, 0 if sub.last_seq is None else sub.last_seq + 1)
                while True:
                    ready = dict(await poller.poll(None if sub.settled else _SETTLE_MS))
                    if not ready:
                        await self._replay(sub, 0 if sub.last_seq is None else sub.last_seq + 1)
                    elif socket in ready:
                        await self._receive(sub, await socket.recv_multipart())
                    elif monitor in ready:
                        await monitor.recv_multipart()
                        raise ConnectionError("disconnected (engine gone, or a frame over the size cap)")
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a helper task: never let it die silently
                self._count("error")
                logger.warning("kv events from %s (%s): %r; reconnecting", sub.name, sub.endpoint, exc)
                self._reset(sub)
                await asyncio.sleep(_RECONNECT_PAUSE)
            finally:
                socket.disable_monitor()
                monitor.close(linger=0)
                socket.close(linger=0)

    async def _receive(self, sub: _Subscription, frames: list[bytes]) -> None:
        seq = _seq(frames[1]) if len(frames) == 3 else None
        if seq is None:
            self._count("malformed")
            self._invalid("frame")
            return
        payload = frames[2]
        if sub.last_seq is not None and seq <= sub.last_seq:
            if seq in sub.replayed:
                return  # already applied by the replay
            self._count("restart")  # numbering went back: the engine restarted
            logger.info("kv events from %s: sequence restarted at %d", sub.name, seq)
            self._reset(sub)
        if sub.last_seq is None and seq > 0:
            # Joined late: what the engine cached before is in its replay buffer.
            await self._replay(sub, 0)
        elif sub.last_seq is not None and seq > sub.last_seq + 1:
            self._count("gap")
            logger.info("kv events from %s: gap %d..%d", sub.name, sub.last_seq + 1, seq - 1)
            await self._replay(sub, sub.last_seq + 1)
        if sub.last_seq is None or seq > sub.last_seq:
            self._accept(sub, seq, payload)
            sub.settled = sub.replay_endpoint is None  # what followed may have been dropped

    def _accept(self, sub: _Subscription, seq: int, payload: bytes) -> None:
        """Apply batch `seq`; one that does not follow the last applied starts a new index."""
        if sub.last_seq is not None and seq != sub.last_seq + 1:
            self._count("reset")
            logger.info("kv events from %s: batches %d..%d lost; index rebuilt", sub.name, sub.last_seq + 1, seq - 1)
            self._reset(sub)
        if not sub.index.apply_payload(payload):
            self._count("malformed")
            self._invalid("batch")
            logger.warning("kv events from %s: undecodable batch %d; index rebuilt", sub.name, seq)
            self._reset(sub)
            sub.last_seq = seq  # what follows is a sound suffix
            return
        sub.last_seq = seq
        sub.fresh = True
        self._count("ok")

    async def _replay(self, sub: _Subscription, start: int) -> None:
        """Apply the batches from `start` on from the engine's replay buffer, if it has one, in
        as many rounds as the reply's gaps take (module docstring)."""
        if sub.replay_endpoint is None:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _REPLAY_DEADLINE
        first: int | None = None  # the first batch this replay applied: live copies from it on are late
        while True:
            before = sub.last_seq
            done, applied_from = await self._replay_round(sub, start, deadline)
            first = applied_from if first is None else first
            if first is not None and sub.last_seq is not None:
                sub.replayed = range(first, sub.last_seq + 1)
            sub.settled = done == "replay" and first is None
            if done is not None:
                self._count(done)
                return
            if sub.last_seq is None or sub.last_seq == before:
                self._count("replay_stalled")  # a round that applied nothing: leave the rest to the live stream
                return
            self._count("replay_gap")
            start = sub.last_seq + 1

    async def _replay_round(self, sub: _Subscription, start: int, deadline: float) -> tuple[str | None, int | None]:
        """One request for the batches from `start` on: applies them while they follow each
        other. Returns the result to count when the replay is over ("replay": answered to the
        end, "replay_timeout", "replay_frame"; None after a gap in the reply: ask again) and
        the first batch applied (None: none)."""
        assert sub.replay_endpoint is not None
        socket = self._socket(zmq.DEALER)
        loop = asyncio.get_running_loop()
        applied = 0
        first: int | None = None
        try:
            socket.connect(sub.replay_endpoint)
            await socket.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                left_ms = int((deadline - loop.time()) * 1000)
                wait_ms = _REPLAY_TAIL_MS if applied else _REPLAY_TIMEOUT_MS
                if left_ms <= 0 or not await socket.poll(min(wait_ms, left_ms)):
                    return ("replay_timeout" if left_ms <= 0 or not applied else None), first
                frames = await socket.recv_multipart()
                if len(frames) == 4 and frames[2] == _END_SEQ:
                    sub.fresh = True  # the engine's buffer, up to its last batch, is in the index
                    return "replay", first
                seq = _seq(frames[2]) if len(frames) == 4 else None
                if seq is None:
                    self._invalid("replay_frame")  # a replay that answers garbage: stop listening
                    return "replay_frame", first
                if sub.last_seq is not None and seq <= sub.last_seq:
                    continue
                if applied and sub.last_seq is not None and seq != sub.last_seq + 1:
                    return None, first  # dropped on the way (the first batch of a reply never is)
                self._accept(sub, seq, frames[3])
                first = seq if first is None else first
                applied += 1
        finally:
            socket.close(linger=0)

    def _reset(self, sub: _Subscription) -> None:
        sub.index = self._new_index(sub)
        sub.last_seq = None
        sub.replayed = range(0)
        sub.fresh = False
