"""Decode-first routing: a request skips the prefill leg when its decode engine already holds the prompt.

Once the policy has picked the decode engine, the decider predicts the prompt tokens that
engine would compute itself: the prompt length minus the hit vLLM's own lookup gives
there (`lookup.predicted_hits`: every KV group, the `prompt_len - 1` cap, the cache-hit
alignment and the EAGLE/MTP drop, replayed over the router's KV index). When that
*uncached* part is small (at most `max_uncached_tokens`, and at most `max_uncached_ratio`
of the prompt), the request goes to decode alone, as the decode-only fallback does: no
prefill leg, no transfer plan. Otherwise it is P/D as before.

A full-attention-only reading (the one a decider sees that ignores sliding-window groups)
calls a prompt cached whose window blocks the engine no longer holds, and the engine then
recomputes all of it; here a sliding-window group without its run makes the prompt P/D.

Invariants:
- a prediction is made only from a fresh index (KV events without an unrepaired gap); no
  index, no token ids, or a request vLLM would not look up (prompt logprobs) or would hash
  differently from the index (a cache salt) is P/D, with the reason named;
- decode's own load bounds local prefills: the uncached tokens of the requests on the local
  route not yet past their first byte, per engine, never exceed
  `max_local_tokens_in_flight`; a request that would is P/D ("busy"). Each reservation is
  released exactly once (`Route.prefilled`), on the first byte, a failure or the end.
  With several router replicas the bound is the fleet's: each keeps its share
  (`replicas.ReplicaSet.share`), so all of them together stay under it;
- a request on the local route whose engine reports its cached prompt tokens is checked
  against the prediction (`pdconnect_router_decode_local_hit_checks`);
- the prediction uses the KV cache groups the engine's connector described
  (`pdconnect.kvdescribe`, read by the engine's index): an engine not described yet, one
  whose description differs from another decode engine's ("groups_disagree"), or from
  `--kv-cache-groups` when that override is given ("groups_override"), is P/D, and the
  log names the engines and the field (once per pair and difference).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from pdconnect.kvdescribe import EngineDescribed, difference
from pdconnect.router.engines import Engine
from pdconnect.router.kvindex import EngineKVIndex
from pdconnect.router.lookup import CacheGroups, described_groups, predicted_hits
from pdconnect.router.metrics import RouterMetrics
from pdconnect.router.prompt import RoutingPrompt
from pdconnect.router.usage import UsageMerger

__all__ = ["DeciderSettings", "DecodeFirstDecider", "IndexSource", "Route"]

logger = logging.getLogger("pdconnect.router.decider")

DECODE_FIRST = "decode-first"
PD = "pd"


class IndexSource(Protocol):
    def index(self, name: str) -> EngineKVIndex | None: ...


@dataclass(frozen=True)
class DeciderSettings:
    groups: CacheGroups | None  # `--kv-cache-groups`: an override the engines' descriptions must match
    max_uncached_tokens: int
    max_uncached_ratio: float
    max_local_tokens_in_flight: int


class Route:
    """One request's decision. `hit`/`full_attention_hit` are predictions (-1: none made)."""

    __slots__ = ("_release", "full_attention_hit", "hit", "local", "prompt_tokens", "reason")

    def __init__(
        self,
        local: bool,
        reason: str,
        prompt_tokens: int = 0,
        hit: int = -1,
        full_attention_hit: int = -1,
        release: Callable[[], None] | None = None,
    ) -> None:
        self.local = local
        self.reason = reason
        self.prompt_tokens = prompt_tokens
        self.hit = hit
        self.full_attention_hit = full_attention_hit
        self._release = release

    @property
    def name(self) -> str:
        return DECODE_FIRST if self.local else PD

    def header(self, detail: bool) -> str:
        """`x-pdconnect-route`: the route and reason; with `detail`, the predicted token counts."""
        text = f"{self.name}; reason={self.reason}"
        if detail and self.hit >= 0:
            text += f"; prompt={self.prompt_tokens}; hit={self.hit}; full_attention_hit={self.full_attention_hit}"
        return text

    def prefilled(self) -> None:
        """The decode engine is past this request's prompt (or never got it): free its share."""
        release, self._release = self._release, None
        if release is not None:
            release()


class DecodeFirstDecider:
    """Decode-first routing: decides the local route vs P/D per request and tracks local prefills per decode engine."""

    def __init__(
        self,
        settings: DeciderSettings,
        indexes: IndexSource,
        metrics: RouterMetrics,
        share: Callable[[int], int] = lambda bound: bound,
    ) -> None:
        self._settings = settings
        self._share = share  # this replica's part of a fleet-wide bound
        self._indexes = indexes
        self._metrics = metrics
        self._in_flight: dict[str, int] = {}  # engine name -> uncached tokens of local prefills
        # The description each decode engine decided for last gave (the pool they must agree in).
        self._described: dict[str, EngineDescribed] = {}
        self._told: set[tuple[str, ...]] = set()  # disagreements logged

    def local_tokens_in_flight(self, name: str) -> int:
        return self._in_flight.get(name, 0)

    def decide(
        self,
        engine: Engine | None,
        prompt: RoutingPrompt | None,
        body: dict[str, Any],
    ) -> Route:
        """The route for a request whose decode engine the policy picked; `prompt`: its tokens
        with the chain keys the policy's lookups computed (`lookup.longest_hit`), or None."""
        route = self._decide(engine, prompt, body)
        self._metrics.decode_routes.labels(route.name, route.reason).inc()
        if route.full_attention_hit >= 0:
            shadow = (
                DECODE_FIRST if self._small(route.prompt_tokens - route.full_attention_hit, route.prompt_tokens) else PD
            )
            self._metrics.decode_routes_full_attention_only.labels(shadow).inc()
        return route

    def _decide(
        self,
        engine: Engine | None,
        prompt: RoutingPrompt | None,
        body: dict[str, Any],
    ) -> Route:
        if engine is None:
            return Route(False, "no_engine")
        if prompt is None or not prompt.tokens:
            return Route(False, "no_tokens")
        if body.get("prompt_logprobs") is not None or body.get("cache_salt") is not None:
            # vLLM skips its lookup for prompt logprobs; a salt changes the engine's
            # hashes but not the content keys the index holds.
            return Route(False, "unpredictable")
        index = self._indexes.index(engine.name)
        if index is None:
            return Route(False, "no_events")
        if index.unplaced_in(prompt):
            return Route(False, "unplaced")  # the engine published a store the index could not place
        groups = self._groups(engine.name, index)
        if isinstance(groups, str):
            return Route(False, groups)
        hit, full_hit = predicted_hits(groups, index, prompt)
        count = len(prompt.tokens)
        uncached = count - hit
        if not self._small(uncached, count):
            return Route(False, "uncached", count, hit, full_hit)
        url = engine.name  # a data-parallel rank prefills on its own engine core
        busy = self._in_flight.get(url, 0)
        if busy + uncached > self._share(self._settings.max_local_tokens_in_flight):
            return Route(False, "busy", count, hit, full_hit)
        self._in_flight[url] = busy + uncached
        self._metrics.decode_first_prefill_tokens.labels().inc(uncached)
        return Route(True, "cached", count, hit, full_hit, release=lambda: self._release(url, uncached))

    def _groups(self, name: str, index: EngineKVIndex) -> CacheGroups | str:
        """The engine's KV cache groups as its connector described them, or why none may be used."""
        described = index.described
        if described is None:
            return "undescribed"
        seen = self._described
        seen[name] = described
        for other in list(seen):
            other_index = self._indexes.index(other) if other != name else index
            if other_index is None or other_index.described is None:
                del seen[other]  # left the pool (or restarted): it no longer constrains the others
                continue
            seen[other] = other_index.described
            if difference(described, seen[other]) is not None:
                first, second = sorted((name, other))  # one log line per pair, whichever asks
                diff = difference(seen[first], seen[second])
                self._tell(
                    ("disagree", first, second, str(diff)),
                    "decode engines %s and %s describe different KV cache groups (%s): their requests go P/D",
                    first,
                    second,
                    diff,
                )
                return "groups_disagree"
        groups = described_groups(described)
        override = self._settings.groups
        if override is not None and set(override.groups) != set(groups.groups):
            self._tell(
                ("override", name, str(groups)),
                "decode engine %s describes KV cache groups %s, not --kv-cache-groups %s: its requests go P/D",
                name,
                groups,
                override,
            )
            return "groups_override"
        return groups

    def _tell(self, key: tuple[str, ...], message: str, *args: object) -> None:
        if key not in self._told:
            self._told.add(key)
            logger.warning(message, *args)

    def _small(self, uncached: int, count: int) -> bool:
        settings = self._settings
        return uncached <= settings.max_uncached_tokens and uncached <= settings.max_uncached_ratio * count

    def _release(self, url: str, tokens: int) -> None:
        left = self._in_flight.get(url, 0) - tokens
        if left > 0:
            self._in_flight[url] = left
        else:
            self._in_flight.pop(url, None)

    def usage_check(self, route: Route) -> UsageMerger:
        """Passes a decode-first answer's usage through unchanged, checking its reported hit."""
        return _HitCheck(route.hit, self._count_check)

    def _count_check(self, predicted: int, reported: int) -> None:
        result = "match" if reported == predicted else ("over" if predicted > reported else "under")
        self._metrics.decode_local_hit_checks.labels(result).inc()


class _HitCheck(UsageMerger):
    """A `UsageMerger` that changes nothing: a decode-first answer's usage is the engine's own
    (it computed the prompt), read once for its `prompt_tokens_details.cached_tokens`."""

    def __init__(self, predicted: int, check: Callable[[int, int], None]) -> None:
        super().__init__(0, None)
        self._predicted = predicted
        self._check: Callable[[int, int], None] | None = check

    def merge(self, usage: dict[str, Any]) -> None:
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if self._check is not None and isinstance(cached, int) and not isinstance(cached, bool):
            self._check(self._predicted, cached)
            self._check = None

    def rewrite_body(self, body: bytes) -> bytes:
        try:
            doc = msgspec.json.decode(body)
        except msgspec.DecodeError:
            return body
        if isinstance(doc, dict) and isinstance(doc.get("usage"), dict):
            self.merge(doc["usage"])
        return body
