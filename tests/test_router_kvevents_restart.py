"""A router restarted mid-run rebuilds its KV index from vLLM's replay, never predicting above what the engine holds.

What the replay no longer holds is predicted as a miss (P/D), never as a hit.

No fakes: a real vLLM `KVCacheManager` (MiMo-V2 shape with MTP) serves multi-turn chats,
its KV events go out through vLLM's own `ZmqEventPublisher` with a replay buffer smaller
than the history, and the router's `KVEventsFeed` joins after most of the history was
published: it asks the replay socket for everything (`kvevents` on a late join), gets
only the buffer, and keeps following the live stream. From then on, every prompt's
predicted hit (`lookup.predicted_hits`, the decider's) is at most what vLLM's manager
reports for it, the recent conversations are predicted exactly, and older ones, still
held by the engine but published before the buffer, are predicted below it (P/D).
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm")

from pdconnect.router.kvevents import KVEventsFeed
from pdconnect.router.lookup import parse_groups, predicted_hits
from pdconnect.router.prompt import RoutingPrompt
from pdconnect.testbed.processes import free_port
from tests.waiting import wait_until_async

ENGINE = "http://mimo-d0:8000"
GROUPS = parse_groups("sliding:64:128:eagle,full:256")
BUFFER_STEPS = 6  # vLLM's replay buffer, in batches: far less than the history


class _Engine:
    """A real manager whose every scheduler step's events vLLM's publisher sends."""

    def __init__(self, endpoint: str, replay: str) -> None:
        from connectors.geometry import Geometry, GroupGeometry
        from tests.kv_manager_steps import events_manager

        self.geometry = Geometry(
            (
                GroupGeometry("sliding_window", 64, 128, eagle=True),
                GroupGeometry("sliding_window", 64, 128, eagle=True),
                GroupGeometry("full_attention", 256),
            )
        )
        self.manager = events_manager(self.geometry, num_blocks=4000)
        from vllm.distributed.kv_events import ZmqEventPublisher

        self.publisher = ZmqEventPublisher(0, endpoint, replay, buffer_steps=BUFFER_STEPS)
        self.published = -1  # the last sequence number sent
        self.served = 0

    def _publish(self) -> None:
        from vllm.distributed.kv_events import KVEventBatch

        events = self.manager.take_events()
        if events:
            self.publisher.publish(KVEventBatch(ts=0.0, events=events))
            self.published += 1

    def sent_everything(self) -> bool:
        """vLLM's publisher thread has sent every batch it was given (its queue is empty)."""
        return bool(self.publisher._event_queue.empty())

    def serve(self, tokens: list[int]) -> None:
        from connectors.kvsim import make_request
        from tests.kv_manager_steps import serve_prompt

        request = make_request(f"r{self.served}", tokens, self.geometry.hash_block_size)
        self.served += 1
        serve_prompt(self.manager, request, 512, between_steps=self._publish)
        self._publish()

    def hit(self, tokens: list[int]) -> int:
        from connectors.kvsim import make_request

        _, hit, _ = self.manager.get_computed_blocks(make_request("probe", tokens, self.geometry.hash_block_size))
        return int(hit)


def _chats(rng: random.Random, count: int) -> list[list[list[int]]]:
    """`count` conversations sharing a system prompt, each a few turns long."""
    system = [rng.randrange(1000, 30000) for _ in range(300)]
    chats = []
    for _ in range(count):
        prompt = system + [rng.randrange(1000, 30000) for _ in range(rng.randrange(300, 900))]
        turns = [prompt]
        for _ in range(2):
            turns.append(turns[-1] + [rng.randrange(1000, 30000) for _ in range(rng.randrange(100, 400))])
        chats.append(turns)
    return chats


def _probe(turns: list[list[int]]) -> list[int]:
    return turns[-1] + [7, 8, 9] * 40  # the conversation's next turn


@pytest.mark.asyncio
async def test_a_router_joining_late_rebuilds_from_the_replay_and_never_predicts_above_vllm() -> None:
    port = free_port()
    replay_port = free_port(exclude=(port,))
    engine = _Engine(f"tcp://*:{port}", f"tcp://*:{replay_port}")  # binds, as an engine does
    endpoint, replay = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}"
    rng = random.Random(32)
    old, recent = _chats(rng, 6), _chats(rng, 2)
    counted: list[str] = []
    feed = KVEventsFeed(lambda url, dp_rank: (endpoint, replay) if url == ENGINE else None, counted.append)
    try:
        for chat in old:  # the history, published before the router starts
            for turns in chat:
                engine.serve(turns)
        assert engine.published + 1 > 3 * BUFFER_STEPS
        # vLLM's publisher sends from a thread of its own: the router joins once the history is
        # sent, or it hears history batches the replay buffer (6 batches) has already dropped.
        await wait_until_async(engine.sent_everything, "the publisher to send the history")
        feed.watch(ENGINE)
        # The SUB socket joins asynchronously, and hears only what is published after: the
        # engine keeps serving (other requests) until the router has heard a batch.
        fillers = iter(_chats(rng, 50))

        def heard() -> bool:
            if feed.applied_sequences():
                return True
            if engine.sent_everything():  # one batch in flight at a time: the buffer outlives a replay
                engine.serve(next(fillers)[0])
            return False

        await wait_until_async(heard, "a live batch heard", observe=lambda: engine.published)

        async def caught_up() -> bool:
            return feed.applied_sequences().get(ENGINE) == engine.published

        checked: list[tuple[str, int, int]] = []
        for chat in recent:  # mid-run: the router follows the live stream from here on
            for turns in chat:
                engine.serve(turns)
                await wait_until_async(
                    caught_up,
                    f"batch {engine.published} applied",
                    observe=lambda: (feed.applied_sequences(), engine.published),
                )
                index = feed.index(ENGINE)
                assert index is not None
                for name, chats in (("old", old), ("recent", recent)):
                    for probe in map(_probe, chats):
                        predicted, _ = predicted_hits(GROUPS, index, RoutingPrompt(probe))
                        real = engine.hit(probe)
                        assert predicted <= real, f"{name} conversation: predicted {predicted}, vLLM holds {real}"
                        checked.append((name, predicted, real))
        assert "replay" in counted and "error" not in counted, counted  # the late join asked the replay socket
        # The suffix taught the index the recent conversations exactly; the old ones, which
        # the engine still holds, are unknown beyond the shared system prompt: below vLLM.
        final = checked[-len(old) - len(recent) :]
        assert all(p == r and r > 300 for name, p, r in final if name == "recent"), final
        assert any(p < r for name, p, r in final if name == "old"), final
    finally:
        await feed.close()
        engine.publisher.shutdown()
