"""Which engine serves a request: kv-aware, prefix affinity, least-loaded or round-robin, by flag.

Prefix affinity is why this router exists. A decode engine can only hit its local
prefix cache for a sibling request (same long prefix, new suffix) if the sibling lands
where the first request's KV was published; the same holds for the prefill engine's
cache. So the key is a hash of the prompt's leading chunk (text for completions, the
rendered messages for chat, token ids when the prompt is ids), placed on a
consistent-hash ring per role: siblings share a key, so they share an engine on every
ring, and adding or removing an engine moves only the keys next to it.

A pure hash ring lets one hot prefix swamp an engine. The ring therefore uses
consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018): an
engine whose in-flight count reached `ceil(factor * (total + 1) / n)` is skipped and
the walk goes on clockwise, so no engine exceeds its share by more than `factor`,
and a key only moves while its engine is over the bound. That bound never drops below
a floor (`LoadBound.floor`): with a handful of requests in flight, `factor` times the
mean is one or two requests, and a burst of siblings would be split although the engine
batches them for about the cost of one sequence, while every split sibling pays a full
KV pull on the engine it spills to. Above the floor the factor rules.

`kv-aware` knows instead of guessing: from each engine's KV events (`kvevents`) it
computes the prefix each engine really caches for the request's tokens and puts the
longest hit first among the engines under the same load bound. The tokens are the ids
the engine will compute (`chat_template`: text tokenized, chat rendered with the model's
template); with none (no `--tokenizer`, a request the router cannot render), no fresh
index, or no hit anywhere, it is prefix affinity. The flow passes the prompt's chain keys
along in the request's `RoutingPrompt`: one request computes them once, off the event
loop for a long prompt (`KvAware.fill_keys`), for every engine it scores and for the decider.

The engines a policy orders are caches: a data-parallel server is one engine per rank
(`engines.py`), each on the ring and scored by its own index, so siblings meet on the
rank that holds their prefix, and the flow pins that rank.

Every policy returns the routable engines in preference order; the flow tries them in
that order, so a retry goes to the key's next engine on the ring and stays stable.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pdconnect.router.engines import Engine
from pdconnect.router.prompt import RoutingPrompt

__all__ = [
    "AffinityTracker",
    "KvAware",
    "LeastLoaded",
    "LoadBound",
    "PrefixAffinity",
    "RoundRobin",
    "RoutingPolicy",
    "affinity_key",
    "make_policy",
    "render_messages",
]


def _hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


# --- the affinity key --------------------------------------------------------------------


def _content_text(content: Any, limit: int) -> str:
    """A message's content as text, at least its first `limit` characters when it has
    them; at most `limit` parts are looked at (a message may hold any number)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # multimodal parts: text, and the identity of any media
        parts = []
        size = 0
        for part in itertools.islice(content, limit):
            if isinstance(part, dict):
                media = part.get("image_url") or part.get("input_audio") or part.get("video_url")
                text = str(part.get("text") or (media.get("url") if isinstance(media, dict) else media) or "")
                parts.append(text)
                size += len(text)
                if size >= limit:
                    break
        return "".join(parts)
    # vLLM refuses any other content; a number is short, a container is not rendered.
    return str(content) if isinstance(content, (int, float)) else ""


def render_messages(messages: Sequence[Any], limit: int) -> str:
    """The messages as one string, `role` and content with separators no chat text uses,
    cut at `limit` characters (only the leading chunk matters, so stop rendering there:
    the work is bounded by `limit`, not by the number or size of the messages)."""
    out: list[str] = []
    size = 0
    # Each message adds at least its two separators, so `limit` messages fill the chunk.
    for message in itertools.islice(messages, limit):
        if not isinstance(message, dict):
            continue
        role = message.get("role", "")
        text = _content_text(message.get("content"), limit)
        piece = f"{role[:limit] if isinstance(role, str) else ''}\x1f{text[:limit]}\x1e"
        out.append(piece)
        size += len(piece)
        if size >= limit:
            break
    return "".join(out)[:limit]


def affinity_key(body: dict[str, Any], chat: bool, prefix_chars: int, prefix_tokens: int) -> int | None:
    """A 64-bit hash of the request's leading chunk; None when there is no prompt to hash."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        return _hash64(render_messages(messages, prefix_chars).encode("utf-8", "surrogatepass"))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch: the first prompt decides
    if isinstance(prompt, str):
        return _hash64(prompt[:prefix_chars].encode("utf-8", "surrogatepass"))
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return _hash64(repr(prompt[:prefix_tokens]).encode())
    return None


# --- policies ----------------------------------------------------------------------------


class RoutingPolicy(Protocol):
    """Orders one role's engines for a request (best first); only routable ones."""

    name: str

    def order(
        self,
        engines: tuple[Engine, ...],
        key: int | None,
        prompt: RoutingPrompt | None = None,
    ) -> list[Engine]: ...


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def order(
        self,
        engines: tuple[Engine, ...],
        key: int | None,
        prompt: RoutingPrompt | None = None,
    ) -> list[Engine]:
        live = [e for e in engines if e.routable]
        if not live:
            return live
        start = next(self._counter) % len(live)
        return live[start:] + live[:start]


class LeastLoaded:
    """Fewest in-flight requests first; ties rotate so equal engines share the work."""

    name = "least-loaded"

    def __init__(self) -> None:
        self._rotation = RoundRobin()

    def order(
        self,
        engines: tuple[Engine, ...],
        key: int | None,
        prompt: RoutingPrompt | None = None,
    ) -> list[Engine]:
        rotated = self._rotation.order(engines, key)
        return sorted(rotated, key=lambda e: e.in_flight)  # stable: ties keep the rotation


class _Ring:
    """`vnodes` points per engine on a 64-bit circle; built once per engine set."""

    def __init__(self, engines: tuple[Engine, ...], vnodes: int) -> None:
        points = sorted(
            (_hash64(f"{engine.name}#{i}".encode()), index)
            for index, engine in enumerate(engines)
            for i in range(vnodes)
        )
        self.engines = engines
        self.hashes = [h for h, _ in points]
        self.owners = [i for _, i in points]

    def walk(self, key: int) -> list[Engine]:
        """Every engine once, in clockwise order from `key`."""
        start = bisect.bisect(self.hashes, key)
        seen: dict[int, None] = {}
        n, total = len(self.engines), len(self.owners)
        for step in range(total):
            seen.setdefault(self.owners[(start + step) % total])
            if len(seen) == n:
                break
        return [self.engines[i] for i in seen]


@dataclass(frozen=True)
class LoadBound:
    """How many in-flight requests one engine of a role may hold before its keys spill.

    `limit(total, n)` = max(floor, ceil(factor * (total + 1) / n)) for `total` requests
    already in flight on `n` engines: no engine exceeds `factor` times its share once the
    role holds more than `floor * n / factor` requests, and none is counted as loaded
    below `floor` (see the module doc). factor >= 1 and floor >= 1 (floor 1: the plain
    bounded-load ring).

    With several router replicas (`replicas.ReplicaSet`) `floor` is the fleet's: each
    replica keeps `floor // replicas()` of it (at least 1), so a burst spread over the
    replicas puts no more than `floor` on one engine; the factor part is relative to the
    replica's own load, which its share of the traffic keeps in proportion.
    """

    factor: float = 1.5
    floor: int = 8
    replicas: Callable[[], int] = field(default=lambda: 1, compare=False)

    def __post_init__(self) -> None:
        if self.factor < 1.0:
            raise ValueError(f"the load factor must be >= 1, got {self.factor}")
        if self.floor < 1:
            raise ValueError(f"the minimum load must be >= 1, got {self.floor}")

    def limit(self, total: int, engines: int) -> int:
        return max(1, self.floor // self.replicas(), math.ceil(self.factor * (total + 1) / engines))


class PrefixAffinity:
    """Consistent hashing with bounded loads over one role's engines (see module doc)."""

    name = "prefix-affinity"

    def __init__(self, load: LoadBound, vnodes: int) -> None:
        self.load = load
        self._vnodes = vnodes
        self._ring: _Ring | None = None
        self._fallback = LeastLoaded()

    def _ring_for(self, engines: tuple[Engine, ...]) -> _Ring:
        if self._ring is None or self._ring.engines is not engines:
            self._ring = _Ring(engines, self._vnodes)
        return self._ring

    def bound(self, live: Sequence[Engine]) -> int:
        """The most in-flight requests one engine may hold before the next one is placed."""
        return self.load.limit(sum(e.in_flight for e in live), len(live))

    def order(
        self,
        engines: tuple[Engine, ...],
        key: int | None,
        prompt: RoutingPrompt | None = None,
    ) -> list[Engine]:
        if key is None:
            return self._fallback.order(engines, key)
        walk = [e for e in self._ring_for(engines).walk(key) if e.routable]
        if not walk:
            return walk
        bound = self.bound(walk)
        for i, engine in enumerate(walk):
            if engine.in_flight < bound:
                return [engine, *walk[:i], *walk[i + 1 :]]
        return walk  # unreachable for factor, floor >= 1; kept total for safety


class HitSource(Protocol):
    """What the kv-aware policy reads an engine's cache through (`kvevents.KVEventsFeed`)."""

    def hit_tokens(self, name: str, prompt: RoutingPrompt) -> int | None: ...

    async def fill_keys(self, prompt: RoutingPrompt) -> None: ...


class KvAware:
    """Longest real cache hit under the affinity load bound; prefix affinity otherwise."""

    name = "kv-aware"

    def __init__(self, hits: HitSource, load: LoadBound, vnodes: int) -> None:
        self._hits = hits
        self._affinity = PrefixAffinity(load, vnodes)

    async def fill_keys(self, prompt: RoutingPrompt) -> None:
        """A long prompt's chain keys, computed off the event loop (`KVEventsFeed.fill_keys`)
        into the prompt that `order` and the decider then read, so one request computes them once."""
        await self._hits.fill_keys(prompt)

    def order(
        self,
        engines: tuple[Engine, ...],
        key: int | None,
        prompt: RoutingPrompt | None = None,
    ) -> list[Engine]:
        ranked = self._affinity.order(engines, key)
        if prompt is None or not prompt.tokens or len(ranked) < 2:
            return ranked
        bound = self._affinity.bound(ranked)
        best, best_hit = None, 0
        for engine in ranked:  # affinity order: ties keep the affinity choice
            if engine.in_flight >= bound:
                continue
            hit = self._hits.hit_tokens(engine.name, prompt) or 0
            if hit > best_hit:
                best, best_hit = engine, hit
        if best is None:
            return ranked
        return [best, *(e for e in ranked if e is not best)]


def make_policy(name: str, load: LoadBound, vnodes: int, hits: HitSource | None = None) -> RoutingPolicy:
    if name == "kv-aware":
        if hits is None:
            raise ValueError("the kv-aware policy needs a KV events feed")
        return KvAware(hits, load, vnodes)
    if name == "prefix-affinity":
        return PrefixAffinity(load, vnodes)
    if name == "least-loaded":
        return LeastLoaded()
    if name == "round-robin":
        return RoundRobin()
    raise ValueError(f"unknown routing policy {name!r}")


class AffinityTracker:
    """Remembers which engine each recent key last used, to count keeps and moves.

    A "move" is a sibling served elsewhere than its predecessor (load bound, failure,
    topology change): its cache is cold there. Bounded LRU, so memory stays flat.
    """

    def __init__(self, capacity: int = 100_000) -> None:
        self._last: OrderedDict[int, str] = OrderedDict()
        self._capacity = capacity

    def observe(self, key: int, engine_url: str) -> str:
        """Record that `key` was served by `engine_url`: 'new', 'keep' or 'move'."""
        previous = self._last.get(key)
        self._last[key] = engine_url
        self._last.move_to_end(key)
        if len(self._last) > self._capacity:
            self._last.popitem(last=False)
        if previous is None:
            return "new"
        return "keep" if previous == engine_url else "move"
