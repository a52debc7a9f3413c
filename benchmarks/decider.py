"""`make bench-decider`: decode-first routing on vs off, the same prompts, fresh engines each.

Two deployments, one after the other: a P/D pair publishing KV events behind the router
(kv-aware), with `--decode-first` off (every request takes the prefill leg) and on (a
request whose decode engine holds all but a few of its prompt tokens goes to decode
alone). Each serves the same traffic:

- multi-turn chat: conversations over `/v1/chat/completions` (the model's chat template),
  streamed, several in flight; each turn's messages carry the previous answers;
- prefix repetition: groups of completions sharing a long token-id prefix.

Per turn it prints TTFT p50/p99 at the client, the prompt tokens the prefill engine
computed, the tokens decode pulled, decode's own prefix-cache hit, the inter-token
latency (ITL) of the streams, the decider's choices and its mispredictions (decode-local
hits the engine reported otherwise), and what a decider reading full-attention KV state
alone would have chosen, with how many of those "cached" prompts decode's own lookup does
not hold (the router's prediction, which the mispredictions count checks).

Then, on the decode engine of the "on" deployment, what local prefills do to concurrent
streams: decode streams' ITL while prompts of a given length are prefilled on the same
engine. The decider's defaults come from that sweep (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from pdconnect.bench.loadgen import percentile
from pdconnect.bench.report import format_table
from pdconnect.bench.scrape import MetricsSnapshot, fetch_metrics
from pdconnect.testbed.local_pd import LocalPDConfig, Transport, start_local_pd
from pdconnect.testbed.processes import Cluster
from pdconnect.testbed.recipes import MODEL_NAME, SPEC
from pdconnect.testbed.tinymodel import FIRST_WORD_ID

__all__ = ["Sizes", "TurnResult", "format_itl", "format_turns", "main", "ratio", "summarize"]

GROUPS = "full:128:eagle,sliding:128:64:eagle"  # the tiny Llama with its EAGLE3 draft


@dataclass(frozen=True)
class Sizes:
    conversations: int = 8
    turns: int = 4
    concurrency: int = 4
    system_words: int = 400
    question_words: int = 48
    answer_tokens: int = 16
    groups: int = 4
    siblings: int = 4
    prefix_tokens: int = 640
    suffix_tokens: int = 48
    itl_streams: int = 3
    itl_stream_tokens: int = 48
    itl_prefills: tuple[int, ...] = (0, 128, 256, 512, 1024)
    seed: int = 7


TINY = Sizes(
    conversations=2,
    turns=2,
    concurrency=2,
    system_words=200,
    question_words=16,
    answer_tokens=4,
    groups=1,
    siblings=2,
    prefix_tokens=256,
    suffix_tokens=16,
    itl_streams=1,
    itl_stream_tokens=8,
    itl_prefills=(0, 128),
)


@dataclass
class Request:
    ttft_s: float
    gaps_s: list[float]
    route: dict[str, str]


@dataclass(frozen=True)
class TurnResult:
    """One turn (or one prefix-repetition round) of one variant, as printed."""

    variant: str
    workload: str
    turn: int
    requests: int
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_s: float
    itl_p99_s: float
    prefill_computed: float
    pulled: float
    decode_hit: float
    local: int
    mispredicted: float
    full_attention_local: int
    full_attention_missed: int


def _route(header: str | None) -> dict[str, str]:
    if not header:
        return {}
    name, *fields = (part.strip() for part in header.split(";"))
    return {"route": name, **dict(f.split("=", 1) for f in fields if "=" in f)}


def _words(rng: random.Random, count: int) -> str:
    return " ".join(f"w{rng.randrange(0, SPEC.vocab_size - FIRST_WORD_ID)}" for _ in range(count))


async def _stream(
    session: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any], need_content: bool = True
) -> tuple[Request, str]:
    """One streamed request: TTFT, the gaps between content chunks, the route, the text."""
    sent = time.perf_counter()
    arrivals: list[float] = []
    text: list[str] = []
    payload = {
        "model": MODEL_NAME,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **body,
    }
    async with session.post(url + path, json=payload) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        route = _route(resp.headers.get("X-PDConnect-Route"))
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            choices = json.loads(line[6:]).get("choices") or []
            piece = (choices[0].get("delta", {}).get("content") or choices[0].get("text")) if choices else None
            if piece:
                arrivals.append(time.perf_counter())
                text.append(piece)
    if not arrivals:
        if need_content:
            raise RuntimeError("a stream without content")
        arrivals.append(time.perf_counter())  # one token that detokenized to nothing
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    return Request(arrivals[0] - sent, gaps, route), "".join(text)


@dataclass
class _Counters:
    snapshot: dict[str, float] = field(default_factory=dict)

    @classmethod
    def scrape(cls, client: httpx.Client, prefill: str, decode: str, router: str) -> _Counters:
        p, d, r = (fetch_metrics(u, client) for u in (prefill, decode, router))
        return cls(
            {
                "prefill_queries": p.total("vllm:prefix_cache_queries"),
                "prefill_hits": p.total("vllm:prefix_cache_hits"),
                "pulled": d.total("vllm:external_prefix_cache_hits"),
                "decode_hits": d.total("vllm:prefix_cache_hits"),
                "mispredicted": _mispredicted(r),
            }
        )

    def __sub__(self, other: _Counters) -> dict[str, float]:
        return {k: v - other.snapshot.get(k, 0.0) for k, v in self.snapshot.items()}


def _mispredicted(router: MetricsSnapshot) -> float:
    return sum(router.total("pdconnect_router_decode_local_hit_checks", result=r) for r in ("over", "under"))


def summarize(
    variant: str, workload: str, turn: int, requests: Sequence[Request], delta: dict[str, float], threshold: int
) -> TurnResult:
    ttfts = [r.ttft_s for r in requests]
    gaps = [g for r in requests for g in r.gaps_s]
    local = sum(r.route.get("route") == "decode-first" for r in requests)
    fa_local = fa_missed = 0
    for r in requests:
        if "full_attention_hit" not in r.route:
            continue
        prompt, fa_hit, hit = int(r.route["prompt"]), int(r.route["full_attention_hit"]), int(r.route["hit"])
        if prompt - fa_hit <= threshold:
            fa_local += 1
            fa_missed += prompt - hit > threshold
    return TurnResult(
        variant,
        workload,
        turn,
        len(requests),
        percentile(ttfts, 50),
        percentile(ttfts, 99),
        percentile(gaps, 50) if gaps else math.nan,
        percentile(gaps, 99) if gaps else math.nan,
        delta["prefill_queries"] - delta["prefill_hits"],
        delta["pulled"],
        delta["decode_hits"],
        local,
        delta["mispredicted"],
        fa_local,
        fa_missed,
    )


async def _chat(
    url: str, sizes: Sizes, client: httpx.Client, urls: tuple[str, str, str], variant: str, threshold: int
) -> list[TurnResult]:
    rng = random.Random(sizes.seed)
    histories: list[list[dict[str, str]]] = [
        [{"role": "system", "content": _words(rng, sizes.system_words)}] for _ in range(sizes.conversations)
    ]
    questions = [[_words(rng, sizes.question_words) for _ in range(sizes.turns)] for _ in range(sizes.conversations)]
    out = []
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        for turn in range(sizes.turns):
            before = _Counters.scrape(client, *urls)
            gate = asyncio.Semaphore(sizes.concurrency)

            async def one(c: int, turn: int = turn, gate: asyncio.Semaphore = gate) -> Request:
                async with gate:
                    histories[c].append({"role": "user", "content": questions[c][turn]})
                    request, answer = await _stream(
                        session,
                        url,
                        "/v1/chat/completions",
                        {"messages": histories[c], "max_tokens": sizes.answer_tokens},
                    )
                    histories[c].append({"role": "assistant", "content": answer})
                    return request

            requests = await asyncio.gather(*(one(c) for c in range(sizes.conversations)))
            await asyncio.sleep(0.5)  # the last KV events and counters settle
            out.append(
                summarize(variant, "chat", turn + 1, requests, _Counters.scrape(client, *urls) - before, threshold)
            )
    return out


async def _prefix_repetition(
    url: str, sizes: Sizes, client: httpx.Client, urls: tuple[str, str, str], variant: str, threshold: int
) -> list[TurnResult]:
    rng = random.Random(sizes.seed + 1)
    vocab = range(FIRST_WORD_ID, SPEC.vocab_size)
    prefixes = [[rng.choice(vocab) for _ in range(sizes.prefix_tokens)] for _ in range(sizes.groups)]
    suffixes = [
        [[rng.choice(vocab) for _ in range(sizes.suffix_tokens)] for _ in range(sizes.siblings)]
        for _ in range(sizes.groups)
    ]
    out = []
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        for round_ in range(sizes.siblings):  # round 1: each group's first; later: its siblings
            before = _Counters.scrape(client, *urls)
            gate = asyncio.Semaphore(sizes.concurrency)

            async def one(g: int, round_: int = round_, gate: asyncio.Semaphore = gate) -> Request:
                async with gate:
                    prompt = prefixes[g] + suffixes[g][round_]
                    request, _ = await _stream(
                        session, url, "/v1/completions", {"prompt": prompt, "max_tokens": sizes.answer_tokens}
                    )
                    return request

            requests = await asyncio.gather(*(one(g) for g in range(sizes.groups)))
            await asyncio.sleep(0.5)
            out.append(
                summarize(variant, "prefix", round_ + 1, requests, _Counters.scrape(client, *urls) - before, threshold)
            )
    return out


async def _itl_sweep(decode: str, sizes: Sizes) -> list[tuple[int, float, float]]:
    """Decode streams' ITL (p50, p99) while prompts of each length are prefilled on the same engine."""
    rng = random.Random(sizes.seed + 2)
    vocab = range(FIRST_WORD_ID, SPEC.vocab_size)
    out = []
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        for length in sizes.itl_prefills:
            streams = [
                _stream(
                    session,
                    decode,
                    "/v1/completions",
                    {"prompt": [rng.choice(vocab) for _ in range(64)], "max_tokens": sizes.itl_stream_tokens},
                )
                for _ in range(sizes.itl_streams)
            ]
            tasks = [asyncio.create_task(s) for s in streams]
            while length and not all(t.done() for t in tasks):  # one local prefill after another
                await _stream(
                    session,
                    decode,
                    "/v1/completions",
                    {"prompt": [rng.choice(vocab) for _ in range(length)], "max_tokens": 1},
                    need_content=False,
                )
            done = [await t for t in tasks]
            gaps = [g for r, _ in done for g in r.gaps_s]
            out.append((length, percentile(gaps, 50), percentile(gaps, 99)))
    return out


def _say(message: str) -> None:
    print(f"[bench-decider] {message}", flush=True)


def run_variant(
    decode_first: bool, sizes: Sizes, transport: Transport, threshold: int, in_flight: int, sweep: bool
) -> tuple[list[TurnResult], list[tuple[int, float, float]]]:
    variant = "on" if decode_first else "off"
    # The decider's settings are given to both: the "off" router predicts nothing (no
    # --decode-first), the same groups and bounds keep the two command lines comparable.
    args = [
        "--kv-cache-groups",
        GROUPS,
        "--decode-first-max-uncached-tokens",
        str(threshold),
        "--decode-first-max-tokens-in-flight",
        str(in_flight),
    ]
    if decode_first:
        args.insert(0, "--decode-first")
    config = LocalPDConfig(transport=transport, kv_events=True, router_args=tuple(args))
    with Cluster() as cluster, httpx.Client(timeout=30) as client:
        _say(f"decider {variant}: starting a fresh P/D pair and the router")
        pd = start_local_pd(cluster, config, name=f"decider-{variant}")
        urls = (pd.prefill.base_url, pd.decode.base_url, pd.router.base_url)
        _say(f"decider {variant}: multi-turn chat")
        turns = asyncio.run(_chat(pd.router.base_url, sizes, client, urls, variant, threshold))
        _say(f"decider {variant}: prefix repetition")
        turns += asyncio.run(_prefix_repetition(pd.router.base_url, sizes, client, urls, variant, threshold))
        itl = asyncio.run(_itl_sweep(pd.decode.base_url, sizes)) if sweep else []
    return turns, itl


def ratio(a: float, b: float) -> str:
    if math.isnan(a) or math.isnan(b) or (a == 0 and b == 0):
        return "-"
    return "inf" if b == 0 else f"{a / b:.2f}x"


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1000:.0f}"


def format_turns(results: Sequence[TurnResult]) -> str:
    headers = [
        "workload",
        "turn",
        "decider",
        "TTFT p50/p99 ms",
        "prefill computed",
        "pulled",
        "decode-local hit",
        "ITL p50/p99 ms",
        "decode-first",
        "mispredicted",
        "FA-only local (missed)",
    ]
    rows = [
        [
            r.workload,
            str(r.turn),
            r.variant,
            f"{_ms(r.ttft_p50_s)}/{_ms(r.ttft_p99_s)}",
            f"{r.prefill_computed:.0f}",
            f"{r.pulled:.0f}",
            f"{r.decode_hit:.0f}",
            f"{_ms(r.itl_p50_s)}/{_ms(r.itl_p99_s)}",
            f"{r.local}/{r.requests}",
            "-" if r.variant == "off" else f"{r.mispredicted:.0f}",
            "-" if r.variant == "off" else f"{r.full_attention_local} ({r.full_attention_missed})",
        ]
        for r in results
    ]
    return format_table(headers, rows, left=3)


def format_ratios(results: Sequence[TurnResult]) -> str:
    by = {(r.workload, r.turn, r.variant): r for r in results}
    rows = []
    for (workload, turn, variant), on in by.items():
        off = by.get((workload, turn, "off"))
        if variant != "on" or off is None:
            continue
        rows.append(
            [
                workload,
                str(turn),
                ratio(on.ttft_p50_s, off.ttft_p50_s),
                ratio(on.ttft_p99_s, off.ttft_p99_s),
                ratio(on.prefill_computed, off.prefill_computed),
                ratio(on.pulled, off.pulled),
                ratio(on.itl_p99_s, off.itl_p99_s),
            ]
        )
    return format_table(
        [
            "workload",
            "turn",
            "TTFT p50 on/off",
            "TTFT p99 on/off",
            "prefill computed on/off",
            "pulled on/off",
            "ITL p99 on/off",
        ],
        rows,
        left=2,
    )


def format_itl(sweep: Sequence[tuple[int, float, float]]) -> str:
    base = sweep[0][2] if sweep and sweep[0][0] == 0 else math.nan
    rows = [[str(length), _ms(p50), _ms(p99), ratio(p99, base)] for length, p50, p99 in sweep]
    return format_table(["local prefill tokens", "ITL p50 ms", "ITL p99 ms", "p99 vs none"], rows)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decider", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--transport", default="mooncake", choices=["mooncake", "nixl"])
    parser.add_argument("--threshold", type=int, default=256, help="--decode-first-max-uncached-tokens")
    parser.add_argument("--in-flight", type=int, default=512, help="--decode-first-max-tokens-in-flight")
    parser.add_argument("--tiny", action="store_true", help="the smallest sizes (the test's)")
    parser.add_argument("--json", type=Path, help="write every figure here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    sizes = TINY if args.tiny else Sizes()
    results: list[TurnResult] = []
    sweep: list[tuple[int, float, float]] = []
    for decode_first in (False, True):
        turns, itl = run_variant(
            decode_first, sizes, args.transport, args.threshold, args.in_flight, sweep=decode_first
        )
        results += turns
        sweep += itl
        print(format_turns(turns), flush=True)  # as it comes: a later failure keeps this
    ordered = sorted(results, key=lambda r: (r.workload, r.turn, r.variant != "off"))
    print(
        f"\nthe same prompts, fresh engines each, decider off vs on (threshold {args.threshold} uncached tokens, "
        f"{args.in_flight} local-prefill tokens in flight per decode engine), {args.transport}"
    )
    print(format_turns(ordered) + "\n")
    print("ratios, on / off")
    print(format_ratios(ordered) + "\n")
    print("decode streams' ITL while the same engine prefills prompts of each length")
    print(format_itl(sweep))
    if args.json:
        args.json.write_text(
            json.dumps({"sizes": asdict(sizes), "turns": [asdict(r) for r in results], "itl_sweep": sweep}, indent=1)
        )
    mispredicted = sum(r.mispredicted for r in results if r.variant == "on")
    if mispredicted:
        print(f"FAIL: {mispredicted:.0f} decode-local hits differ from the prediction", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
