"""Send scenario steps to a running P/D deployment and measure them: TTFT and throughput at the
client, prefix-cache hits on the engines.

Every request is a streamed `/v1/completions` call to the router (time to first token is
the first streamed event with a choice, so it includes the prefill leg and the KV load);
`ignore_eos` fixes the output length. The hit figures are differences of the engines'
own counters, scraped from each engine's `/metrics` before and after a step and summed
over the engines of a role:

- decode-local hit: `vllm:prefix_cache_hits` on decode engines — what replay slack is for;
- decode external hit: `vllm:external_prefix_cache_hits` on decode engines (pulled KV);
- prefill-local hit: `vllm:prefix_cache_hits` on prefill engines;
- `pdconnect:slack_blocks_published` on decode engines (our connector only);
- `pdconnect:coalesced_waits` on decode engines: requests that waited for a sibling's
  load in flight instead of pulling the same blocks (our connector only);
- with a reference (a colocated engine: same model and flags, no connector), every
  step's prompts are sent to it as well, after the deployment served them, and its own
  `vllm:prefix_cache_hits` is what decode's local hit should equal. Siblings' hits depend
  on the order they arrive in, so `Deployment.reference_order` may replay them in the
  order the decode engine admitted them (read from its logs by the router's request ids).

Conversation steps (`Step.turn`, the multi-turn scenario) ask for the generated token
ids (`return_token_ids`) and build each turn's prompts from the previous turn's prompts
and the deployment's answers; the reference gets exactly those prompts, so both see the
same token sequences, and a per-step count says how many of its answers were the same.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal, Self

import aiohttp
import httpx
import msgspec
from tqdm import tqdm

from pdconnect.bench.scenarios import Prompt, Scenario, Step, TokenSource, warmup_step
from pdconnect.bench.scrape import MetricsSnapshot, PrefixCacheCounters, engine_client, fetch_metrics

__all__ = [
    "Deployment",
    "LoadGenerator",
    "RequestResult",
    "RoleCounters",
    "RunResult",
    "StepResult",
    "in_prompt_order",
    "percentile",
    "render_prompt",
    "reordered",
    "replay_order",
    "run_scenario",
]

PromptFormat = Literal["ids", "text"]
# Text prompts render id `i` as the word `w{i - first_word_id}`. 7 is where words start in
# the tiny test models' tokenizer (after 4 special and 3 role tokens); a test checks that
# `pdconnect.testbed.tinymodel.FIRST_WORD_ID` agrees.
DEFAULT_FIRST_WORD_ID = 7
FALLBACK_HEADER = "X-PDConnect-Fallback"
# Steps with fewer requests finish too quickly for a progress bar to say anything.
PROGRESS_MIN_REQUESTS = 8
MAX_ERRORS_KEPT = 5


def _engine_base(url: str) -> str:
    """An engine's base URL from either its base or its `/metrics` URL."""
    url = url.rstrip("/")
    return url.removesuffix("/metrics")


@dataclass(frozen=True)
class Deployment:
    """Where to send requests and where to read counters; nothing else about the deployment
    is assumed (any router that speaks the OpenAI API and passes `ignore_eos` works)."""

    router: str
    prefill_metrics: tuple[str, ...] = ()
    decode_metrics: tuple[str, ...] = ()
    model: str = "tiny"
    prompt_format: PromptFormat = "ids"
    # Text prompts: the id rendered as the word `w0` (see `render_prompt`).
    first_word_id: int = DEFAULT_FIRST_WORD_ID
    request_timeout_s: float = 600.0
    # A colocated engine's base URL: requests and counters both go there.
    reference: str | None = None
    # How many requests at once the reference replays (None: as the step sends them).
    # 1 measures what serial siblings hit, the figure coalescing is held to.
    reference_concurrency: int | None = None
    # The order to replay a step's prompts on the reference, from the router's request
    # ids of the deployment's requests (prompt order; "" where none came back): a
    # permutation of the prompt indices, or None for the order they were sent in.
    reference_order: Callable[[tuple[str, ...]], Sequence[int] | None] | None = None
    # (name, value) pairs sent with every request to the router, e.g. its clients'
    # `Authorization` (the router passes that one on to engines started with --api-key).
    headers: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "router", self.router.rstrip("/"))
        object.__setattr__(self, "prefill_metrics", tuple(_engine_base(u) for u in self.prefill_metrics))
        object.__setattr__(self, "decode_metrics", tuple(_engine_base(u) for u in self.decode_metrics))
        if self.reference is not None:
            object.__setattr__(self, "reference", _engine_base(self.reference))
        if self.reference_concurrency is not None and self.reference_concurrency < 1:
            raise ValueError(f"reference_concurrency must be >= 1, got {self.reference_concurrency}")


def render_prompt(
    prompt: Prompt, prompt_format: PromptFormat, first_word_id: int = DEFAULT_FIRST_WORD_ID
) -> list[int] | str:
    """Token ids as they are, or as words `w{id - first_word_id}` (one token each in the tiny
    models' tokenizer; on a real tokenizer a word is a few tokens, and equal word prefixes
    stay equal token prefixes because words are whitespace-separated)."""
    if prompt_format == "ids":
        return list(prompt)
    if min(prompt) < first_word_id:
        raise ValueError(f"text prompts need token ids >= {first_word_id}")
    return " ".join(f"w{i - first_word_id}" for i in prompt)


def mean(values: Sequence[float]) -> float:
    """The arithmetic mean; NaN when empty (a step with no successful request)."""
    return sum(values) / len(values) if values else math.nan


def poisson_arrivals(requests: int, rate: float, rng: random.Random) -> tuple[float, ...]:
    """When each of `requests` is sent, in seconds after the first (sent at 0): a Poisson
    process of `rate` requests per second, i.e. exponential gaps, as vLLM's bench draws them."""
    if rate <= 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    gaps = [0.0] + [rng.expovariate(rate) for _ in range(requests - 1)]
    return tuple(itertools.accumulate(gaps))[:requests]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation (numpy's default); NaN when empty."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


# ---------------------------------------------------------------------------------------
# Engine counters


@dataclass(frozen=True)
class RoleCounters:
    """One role's counters summed over its engines (tokens, except the block counts).

    `engines` is how many engines were scraped; 0 means the role was not measured, and
    the report shows a dash rather than a zero that would read as "no hits".
    """

    engines: int = 0
    cache: PrefixCacheCounters = PrefixCacheCounters(0.0, 0.0, 0.0, 0.0)
    slack_blocks_published: float = 0.0
    slack_blocks_pulled: float = 0.0
    transfers: float = 0.0
    transfer_failures: float = 0.0
    # Time the connector spent pulling (sum over loads): tells transfer cost from the rest of TTFT.
    transfer_seconds: float = 0.0
    # Requests that waited for a sibling's load (coalescing), and waits that timed out.
    coalesced_waits: float = 0.0
    coalesce_timeouts: float = 0.0

    @classmethod
    def from_snapshot(cls, snapshot: MetricsSnapshot, engines: int) -> RoleCounters:
        return cls(
            engines=engines,
            cache=PrefixCacheCounters.from_snapshot(snapshot),
            slack_blocks_published=snapshot.total("pdconnect:slack_blocks_published"),
            slack_blocks_pulled=snapshot.total("pdconnect:blocks_slack"),
            transfers=snapshot.total("pdconnect:transfers"),
            transfer_failures=snapshot.total("pdconnect:transfer_failures"),
            transfer_seconds=snapshot.total("pdconnect:transfer_seconds_sum"),
            coalesced_waits=snapshot.total("pdconnect:coalesced_waits"),
            coalesce_timeouts=snapshot.total("pdconnect:coalesce_timeouts"),
        )

    def __sub__(self, other: RoleCounters) -> RoleCounters:
        return RoleCounters(
            engines=self.engines,
            cache=self.cache - other.cache,
            **{
                f.name: getattr(self, f.name) - getattr(other, f.name)
                for f in dataclasses.fields(self)
                if f.name not in ("engines", "cache")
            },
        )


def _scrape(urls: Sequence[str], client: httpx.Client) -> MetricsSnapshot:
    """All engines' samples in one snapshot: its totals are sums over the engines."""
    return MetricsSnapshot(tuple(s for url in urls for s in fetch_metrics(url, client).samples))


def transport_in_use(snapshot: MetricsSnapshot) -> str | None:
    """What our connector reports as really in use (`pdconnect:transport_info`), if anything."""
    for name, labels, value in snapshot.samples:
        if name == "pdconnect:transport_info" and value == 1.0:
            return dict(labels).get("transport")
    return None


# ---------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True)
class RequestResult:
    ok: bool
    latency_s: float
    ttft_s: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    fallback: bool = False
    error: str | None = None
    # The generated token ids, when asked for (conversation steps, reference runs).
    output_ids: tuple[int, ...] = ()
    # time.perf_counter() when the request was sent.
    sent_at: float = 0.0
    # Inter-token latencies: the gaps between successive streamed events that carry
    # output (a server may put several tokens in one event: that gap counts once).
    itl_s: tuple[float, ...] = ()
    # The router's request id (its `X-Request-Id` answer header); "" when none came back.
    request_id: str = ""

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (vLLM's TPOT); None below two tokens."""
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True)
class StepResult:
    """One step's measurements; derived figures are properties so the raw data stays the record."""

    scenario: str
    step: str
    requests: int
    concurrency: int
    output_len: int
    ok: int
    fallbacks: int
    prompt_tokens: int
    output_tokens: int
    duration_s: float
    ttft_s: tuple[float, ...]
    decode: RoleCounters
    prefill: RoleCounters
    errors: tuple[str, ...] = ()
    turn: int = 0
    # The colocated reference engine on the same prompts (engines=0: none was given).
    reference: RoleCounters = RoleCounters()
    # How many of the step's answers the reference generated identically (None: no reference).
    reference_same_outputs: int | None = None
    # The prompt indices in the order the reference replayed them (empty: as sent).
    reference_order: tuple[int, ...] = ()
    # Per request, in prompt order: its shared-prefix group (the step's `groups`; empty
    # when it has none), when it was sent (seconds after the step began), its TTFT
    # (None: it failed) and its request id. Who ran beside whom is read from these
    # (`sibling_roles`).
    groups: tuple[int, ...] = ()
    sent_s: tuple[float, ...] = ()
    request_ttft_s: tuple[float | None, ...] = ()
    request_ids: tuple[str, ...] = ()  # the router's ("" where none came back)
    # Each successful request's TPOT (two tokens or more), and every inter-token gap of
    # the step's successful requests pooled.
    tpot_s: tuple[float, ...] = ()
    itl_s: tuple[float, ...] = ()

    @property
    def failed(self) -> int:
        return self.requests - self.ok

    @property
    def ttft_mean_s(self) -> float:
        return mean(self.ttft_s)

    @property
    def ttft_p99_s(self) -> float:
        return percentile(self.ttft_s, 99)

    @property
    def tpot_mean_s(self) -> float:
        return mean(self.tpot_s)

    @property
    def itl_p99_s(self) -> float:
        return percentile(self.itl_s, 99)

    @property
    def request_throughput(self) -> float:
        """Successful requests per second of the step's wall time."""
        return self.ok / self.duration_s if self.duration_s > 0 else math.nan

    def to_json(self) -> dict[str, Any]:
        return {
            **dataclasses.asdict(self),
            "failed": self.failed,
            "ttft_mean_s": self.ttft_mean_s,
            "ttft_p99_s": self.ttft_p99_s,
            "tpot_mean_s": self.tpot_mean_s,
            "itl_p99_s": self.itl_p99_s,
            "request_throughput": self.request_throughput,
            "decode_local_hit_tokens": self.decode.cache.hits,
            "decode_external_hit_tokens": self.decode.cache.external_hits,
            "prefill_local_hit_tokens": self.prefill.cache.hits,
            "reference_local_hit_tokens": self.reference.cache.hits if self.reference.engines else None,
        }


@dataclass(frozen=True)
class RunResult:
    """Every step measured against one deployment, with what describes that deployment."""

    label: str
    steps: tuple[StepResult, ...]
    settings: dict[str, Any] = field(default_factory=dict)
    transport: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "settings": self.settings,
            "transport": self.transport,
            "steps": [s.to_json() for s in self.steps],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunResult:
        """Back from `to_json` (derived figures are recomputed, not read)."""
        return msgspec.convert(data, cls)


# ---------------------------------------------------------------------------------------
# Sending


class LoadGenerator:
    """An open HTTP session to a deployment's router plus a scraper for its engines.

    Use as an async context manager; one generator runs steps one after the other (the
    counters of concurrent steps could not be told apart).
    """

    def __init__(
        self,
        deployment: Deployment,
        *,
        progress: bool | None = None,
        request_rate: float | None = None,
        arrival_seed: int = 0,
    ) -> None:
        self.deployment = deployment
        # Open loop: requests to the router arrive as a Poisson process of this rate
        # (requests per second), whether or not earlier ones have finished, and a step's
        # `concurrency` caps only how many are in flight. None: closed loop, each of
        # `concurrency` workers sends its next request when its last one ends.
        if request_rate is not None and request_rate <= 0:
            raise ValueError(f"request rate must be positive, got {request_rate}")
        self._request_rate = request_rate
        self._arrivals = random.Random(arrival_seed)
        # None: bars only on a terminal (tqdm's rule), and only for long steps.
        self._progress = progress
        self._session: aiohttp.ClientSession | None = None
        self._scraper: httpx.Client | None = None
        # Each open conversation so far (prompt + answer of its last turn), by index.
        self._conversations: list[Prompt] = []

    async def __aenter__(self) -> Self:
        self._scraper = engine_client(30.0)
        timeout = aiohttp.ClientTimeout(total=self.deployment.request_timeout_s)
        # No per-host connection cap below the step's concurrency; a large read buffer so a
        # long SSE line never trips aiohttp's line limit.
        self._session = aiohttp.ClientSession(
            timeout=timeout, read_bufsize=1 << 20, connector=aiohttp.TCPConnector(limit=0)
        )
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._session is not None:
            await self._session.close()
        if self._scraper is not None:
            self._scraper.close()

    async def _scrape(self, urls: Sequence[str]) -> MetricsSnapshot:
        assert self._scraper is not None, "use LoadGenerator as an async context manager"
        return await asyncio.to_thread(_scrape, urls, self._scraper)

    async def counters(self) -> tuple[RoleCounters, RoleCounters]:
        """(prefill, decode) counters now."""
        d = self.deployment
        # One after the other: the scraper is one httpx client, not to be shared across threads.
        prefill = await self._scrape(d.prefill_metrics)
        decode = await self._scrape(d.decode_metrics)
        return (
            RoleCounters.from_snapshot(prefill, len(d.prefill_metrics)),
            RoleCounters.from_snapshot(decode, len(d.decode_metrics)),
        )

    async def transport(self) -> str | None:
        """The transport the decode engines report in use (our connector only)."""
        return transport_in_use(await self._scrape(self.deployment.decode_metrics))

    async def warm_up(self, step: Step) -> None:
        """Send `step` unmeasured (to the reference too); a failure means something is not serving."""
        targets: list[str | None] = [None] if self.deployment.reference is None else [None, self.deployment.reference]
        for target in targets:
            results = await self._send_all(step, label="warm-up", target=target)
            failed = [r.error for r in results if not r.ok]
            if failed:
                raise RuntimeError(
                    f"warm-up failed for {len(failed)} of {len(results)} requests"
                    f"{' on the reference' if target else ''}: {failed[0]}"
                )

    def _prompts(self, step: Step) -> tuple[Prompt, ...]:
        """What a step really sends: conversation turns after the first carry their history."""
        if step.turn <= 1:
            return step.prompts
        if len(self._conversations) != len(step.prompts):
            raise RuntimeError(
                f"step {step.name!r} continues {len(step.prompts)} conversations but "
                f"{len(self._conversations)} are open: run its turn 1 first"
            )
        return tuple(history + question for history, question in zip(self._conversations, step.prompts))

    async def run_step(self, scenario: str, step: Step) -> StepResult:
        step = dataclasses.replace(step, prompts=self._prompts(step))
        reference = self.deployment.reference
        want_ids = step.turn > 0 or reference is not None
        prefill_before, decode_before = await self.counters()
        started = time.perf_counter()
        results = await self._send_all(step, label=f"{scenario}: {step.name}", want_ids=want_ids)
        duration = time.perf_counter() - started
        prefill_after, decode_after = await self.counters()
        if step.turn > 0:
            # A failed request has no answer: its next turn goes on without one (and the
            # failure is in this step's figures).
            self._conversations = [p + r.output_ids for p, r in zip(step.prompts, results, strict=True)]
        request_ids = tuple(r.request_id for r in results)
        reference_counters, same = RoleCounters(), None
        order: tuple[int, ...] = ()
        if reference is not None:
            # After the deployment served the step, so the two never compete for the CPU.
            before = RoleCounters.from_snapshot(await self._scrape([reference]), 1)
            if self.deployment.reference_order is not None:
                order = replay_order(self.deployment.reference_order(request_ids), len(step.prompts))
            replay = reordered(step, order)
            if self.deployment.reference_concurrency is not None:
                replay = dataclasses.replace(replay, concurrency=self.deployment.reference_concurrency)
            replayed = in_prompt_order(
                await self._send_all(
                    replay, label=f"{scenario}: {step.name} (reference)", target=reference, want_ids=True
                ),
                order,
            )
            reference_counters = RoleCounters.from_snapshot(await self._scrape([reference]), 1) - before
            same = sum(r.ok and q.ok and r.output_ids == q.output_ids for r, q in zip(results, replayed, strict=True))
        good = [r for r in results if r.ok]
        return StepResult(
            scenario=scenario,
            step=step.name,
            requests=len(results),
            concurrency=step.concurrency,
            output_len=step.output_len,
            ok=len(good),
            fallbacks=sum(r.fallback for r in results),
            prompt_tokens=sum(r.prompt_tokens for r in good),
            output_tokens=sum(r.output_tokens for r in good),
            duration_s=duration,
            ttft_s=tuple(r.ttft_s for r in good if r.ttft_s is not None),
            decode=decode_after - decode_before,
            prefill=prefill_after - prefill_before,
            errors=tuple(r.error for r in results if r.error)[:MAX_ERRORS_KEPT],
            turn=step.turn,
            reference=reference_counters,
            reference_same_outputs=same,
            groups=step.groups,
            sent_s=tuple(r.sent_at - started for r in results),
            request_ttft_s=tuple(r.ttft_s if r.ok else None for r in results),
            tpot_s=tuple(r.tpot_s for r in good if r.tpot_s is not None),
            itl_s=tuple(gap for r in good for gap in r.itl_s),
            request_ids=request_ids,
            reference_order=order,
        )

    async def _send_all(
        self, step: Step, label: str, *, target: str | None = None, want_ids: bool = False
    ) -> list[RequestResult]:
        """Send in order with at most `step.concurrency` in flight; results in prompt order.

        `target`: an engine's base URL instead of the router.
        """
        results: list[RequestResult | None] = [None] * len(step.prompts)
        queue: asyncio.Queue[int] = asyncio.Queue()
        for index in range(len(step.prompts)):
            queue.put_nowait(index)
        with tqdm(
            total=len(step.prompts), desc=label, unit="req", leave=False, disable=self._bar_disabled(len(step.prompts))
        ) as bar:

            async def worker() -> None:
                while not queue.empty():
                    index = queue.get_nowait()
                    results[index] = await self._send(step.prompts[index], step.output_len, target, want_ids)
                    bar.update(1)

            async def arrive(index: int, at: float, in_flight: asyncio.Semaphore, start: float) -> None:
                await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
                async with in_flight:
                    results[index] = await self._send(step.prompts[index], step.output_len, target, want_ids)
                bar.update(1)

            # A reference engine replays closed-loop: it is measured for hits, not latency.
            if self._request_rate is not None and target is None:
                arrivals = poisson_arrivals(len(step.prompts), self._request_rate, self._arrivals)
                in_flight, start = asyncio.Semaphore(step.concurrency), time.perf_counter()
                await asyncio.gather(*(arrive(i, at, in_flight, start) for i, at in enumerate(arrivals)))
            else:
                await asyncio.gather(*(worker() for _ in range(min(step.concurrency, len(step.prompts)))))
        return [r for r in results if r is not None]

    def _bar_disabled(self, requests: int) -> bool | None:
        """tqdm's `disable`: None lets tqdm decide (on only on a terminal)."""
        if self._progress is False or requests < PROGRESS_MIN_REQUESTS:
            return True
        return None if self._progress is None else False

    async def _send(
        self, prompt: Prompt, output_len: int, target: str | None = None, want_ids: bool = False
    ) -> RequestResult:
        assert self._session is not None, "use LoadGenerator as an async context manager"
        d = self.deployment
        body = {
            "model": d.model,
            "prompt": render_prompt(prompt, d.prompt_format, d.first_word_id),
            "max_tokens": output_len,
            "temperature": 0.0,
            "ignore_eos": True,  # random weights emit EOS now and then; fix the length
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if want_ids:
            body["return_token_ids"] = True  # vLLM: each streamed choice carries its token ids
        started = time.perf_counter()
        ttft: float | None = None
        usage: dict[str, Any] = {}
        output_ids: list[int] = []
        itl: list[float] = []
        last_output: float | None = None
        try:
            # The headers are the router's clients'; a reference engine is reached directly.
            headers = dict(d.headers) if target is None else None
            async with self._session.post(f"{target or d.router}/v1/completions", json=body, headers=headers) as resp:
                fallback = FALLBACK_HEADER in resp.headers
                request_id = resp.headers.get("X-Request-Id", "")
                if resp.status != 200:
                    text = (await resp.text())[:300]
                    return RequestResult(
                        False,
                        time.perf_counter() - started,
                        fallback=fallback,
                        error=f"HTTP {resp.status}: {text}",
                        sent_at=started,
                        request_id=request_id,
                    )
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    event = json.loads(data)
                    if "error" in event:
                        return RequestResult(
                            False,
                            time.perf_counter() - started,
                            ttft,
                            fallback=fallback,
                            error=f"stream error: {event['error']}",
                            sent_at=started,
                            request_id=request_id,
                        )
                    if event.get("choices"):
                        now = time.perf_counter()
                        if ttft is None:
                            ttft = now - started
                        if last_output is not None:
                            itl.append(now - last_output)
                        last_output = now
                    for choice in event.get("choices") or ():
                        output_ids.extend(choice.get("token_ids") or ())
                    usage = event.get("usage") or usage
        except (aiohttp.ClientError, TimeoutError) as exc:
            return RequestResult(
                False, time.perf_counter() - started, ttft, error=f"{type(exc).__name__}: {exc}", sent_at=started
            )
        error = None if ttft is not None else "stream ended without a token"
        if error is None and want_ids and not output_ids:
            error = "no token_ids in the stream: the server ignored return_token_ids"
        return RequestResult(
            ok=error is None,
            latency_s=time.perf_counter() - started,
            ttft_s=ttft,
            prompt_tokens=int(usage.get("prompt_tokens", 0)),
            output_tokens=int(usage.get("completion_tokens", 0)),
            fallback=fallback,
            error=error,
            output_ids=tuple(output_ids),
            sent_at=started,
            itl_s=tuple(itl),
            request_id=request_id,
        )


def replay_order(order: Sequence[int] | None, count: int) -> tuple[int, ...]:
    """`Deployment.reference_order`'s answer checked: a permutation of `count` prompt
    indices, or () for the order sent (None, or that very order)."""
    if order is None:
        return ()
    if sorted(order) != list(range(count)):
        raise ValueError(f"a reference order must be a permutation of 0..{count - 1}, got {list(order)}")
    return () if list(order) == list(range(count)) else tuple(order)


def reordered(step: Step, order: tuple[int, ...]) -> Step:
    """`step` with its prompts (and their groups) in `order`; `step` itself for ()."""
    if not order:
        return step
    groups = tuple(step.groups[i] for i in order) if step.groups else ()
    return dataclasses.replace(step, prompts=tuple(step.prompts[i] for i in order), groups=groups)


def in_prompt_order(results: Sequence[RequestResult], order: tuple[int, ...]) -> list[RequestResult]:
    """Results of a step sent in `order` (see `reordered`) put back in prompt order."""
    if not order:
        return list(results)
    back: list[RequestResult | None] = [None] * len(order)
    for position, index in enumerate(order):
        back[index] = results[position]
    return [r for r in back if r is not None]


async def run_scenario(
    generator: LoadGenerator,
    scenario: Scenario,
    tokens: TokenSource,
    warmups: int = 0,
    *,
    serial: bool = False,
) -> list[StepResult]:
    """Warm up with `warmups` unrelated prompts of the scenario's shape, then run its steps.

    `serial`: every step one request at a time, same prompts (a colocated engine measured
    this way gives what serial siblings hit).
    """
    steps = scenario.steps(tokens)
    if serial:
        steps = [dataclasses.replace(step, concurrency=1) for step in steps]
    if warmups > 0:
        # A forked source: the warm-ups never share a prefix with the measured prompts,
        # and the measured prompts do not depend on how many warm-ups there were.
        await generator.warm_up(warmup_step(tokens.fork(), warmups, scenario.prompt_len()))
    return [await generator.run_step(scenario.name, step) for step in steps]
