"""`make bench-fleet`: the router's KV index at fleet scale, fed by many decode engine cores' vLLM events.

Each engine core is a real vLLM `KVCacheManager` (`connectors.kvsim`, no model) serving a
chat workload in the scheduler's call order: conversations of up to 128k tokens that share
a system prompt, each first sent as its history so far and then extended turn by turn, the
turns of all conversations interleaved, prefills chunked as the scheduler chunks them.
After every step the manager's queued KV events are encoded as vLLM's `KVEventBatch`
(vLLM's own classes, stamped with the core's data-parallel rank), which is what its
`ZmqEventPublisher` sends. Engines are recorded one at a time in a child process (the
router process never holds a manager), and the router process takes each engine's
batches in through its real ingest path, `EngineKVIndex.apply_payload` (decode of the
wire batch, then the index), timed on one core.

Then, for probes (a next turn of a sampled conversation of each engine), the router's
per-request lookup path is timed across every engine: the prompt's chain keys
(`RoutingPrompt.fill`, which `KVEventsFeed.fill_keys` runs off the loop), the kv-aware
policy's `hit_tokens` on every engine core, and the decider's `unplaced_in` and
`predicted_hits` on the chosen one. Every probe's predicted hit is checked against what
the engine's vLLM manager itself reports for it.

Restart: a router that joins late gets from each engine's replay socket only its buffer
(vLLM's `buffer_steps`, set smaller than the history here): the last batches. Each engine's
index is rebuilt from those alone (timed), and every probe's prediction on it must be at
most what vLLM holds: what the suffix does not show is unknown, predicted as a miss
(P/D), never as a hit. `tests/test_router_kvevents_restart.py` checks the same through the
real replay socket.

Memory: the router process's resident set after each engine's ingest against the blocks
all indexes hold; the slope of a least-squares line is the bytes per cached block.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import json
import math
import multiprocessing
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from array import array
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pdconnect.router.engines import engine_name
from pdconnect.router.kvindex import EngineKVIndex
from pdconnect.router.lookup import parse_groups, predicted_hits
from pdconnect.router.prompt import RoutingPrompt

# name -> (KV cache groups as vLLM's engine reports them: kind, block size, window,
# EAGLE/MTP drop, prefix-cacheable), and the decider's groups (`--kv-cache-groups`).
Group = tuple[str, int, int | None, bool, bool]
GEOMETRIES: dict[str, tuple[tuple[Group, ...], str]] = {
    # MiMo-V2 with MTP: two sliding groups of one spec, full attention numbered last.
    "mimo-v2-mtp": (
        (
            ("sliding_window", 64, 128, True, True),
            ("sliding_window", 64, 128, True, True),
            ("full_attention", 256, None, False, True),
        ),
        "sliding:64:128:eagle,full:256",
    ),
    # DeepSeek-V4-like (`pdconnect plan`'s DeepSeek-V4.1 example): sliding 64/128 and full
    # 256 under MTP, plus the bounded-replay window vLLM does not prefix-cache.
    "dsv4-like-mtp": (
        (
            ("sliding_window", 64, 128, True, True),
            ("full_attention", 256, None, True, True),
            ("sliding_window", 64, 128, True, False),
        ),
        "full:256:eagle,sliding:64:128:eagle",
    ),
}
SYSTEM_PROMPT_SEED = 1234


@dataclass(frozen=True)
class Workload:
    engines: int = 64
    dp_ranks: int = 4  # engine cores per server: engines / dp_ranks servers
    conversations: int = 200  # per engine core
    min_tokens: int = 4096
    max_tokens: int = 131072
    system_tokens: int = 2048
    chunk: int = 8192  # tokens per prefill step (max_num_batched_tokens)
    probes: int = 4  # conversations per engine probed after the run
    replay_steps: int = 500  # the replay buffer a late-joining router reads (< the history)
    # Per engine core: the publish load the ingest is compared with. A decode core streaming
    # ~100 answers of ~600 tokens at ~30 tokens/s finishes ~5 a second; each next request
    # brings the bench's mean new tokens (first requests carry a whole history: pessimistic).
    requests_per_s: float = 5.0
    seed: int = 0


@dataclass
class EngineTrace:
    """One engine core's published batches and what its vLLM manager reports for the probes."""

    name: str
    dp_rank: int
    payloads: list[bytes]
    events: list[int]  # per payload
    requests: int
    new_tokens: int
    removed_blocks: int
    probes: list[array[int]] = field(default_factory=list)
    real_hits: list[int] = field(default_factory=list)


def _tokens(rng: random.Random, n: int) -> array[int]:
    return array("H", rng.randbytes(2 * n))  # token ids < 65536: a real vocabulary's range


def _conversation(rng: random.Random, work: Workload) -> list[array[int]]:
    """One conversation's segments: its history so far (after the system prompt), then
    turns of (answer, user message); request k's prompt is the system prompt and segments
    0..k. At most `max_tokens` in all."""
    total = int(math.exp(rng.uniform(math.log(work.min_tokens), math.log(work.max_tokens))))
    first = max(1, int(total * rng.uniform(0.5, 0.9)) - work.system_tokens)
    segments, length = [_tokens(rng, first)], work.system_tokens + first
    while True:
        turn = rng.randrange(200, 1000) + rng.randrange(500, 4000)
        if length + turn > total:
            return segments
        segments.append(_tokens(rng, turn))
        length += turn


def record_engine(geometry_name: str, engine_no: int, work: Workload) -> EngineTrace:
    """Serve one engine core's workload through vLLM's manager; its KV event batches as published."""
    import msgspec
    from vllm.distributed.kv_events import BlockRemoved, KVEventBatch

    from connectors.geometry import Geometry, GroupGeometry
    from connectors.kvsim import SimulatedEngine
    from connectors.vllm_adapter import build_kv_cache_manager

    groups, _ = GEOMETRIES[geometry_name]
    geometry = Geometry(tuple(GroupGeometry(k, b, w, e, c) for k, b, w, e, c in groups))  # type: ignore[arg-type]  # kinds are GroupKind literals
    rng = random.Random(f"{work.seed}/{engine_no}")
    system = _tokens(random.Random(SYSTEM_PROMPT_SEED), work.system_tokens)
    conversations = [_conversation(rng, work) for _ in range(work.conversations)]
    held = sum(len(system) + sum(map(len, c)) for c in conversations)
    # The pool holds every conversation's full-attention blocks, the sliding runs kept, and
    # the prefill of the longest prompt: "each holding" its conversations (LRU evicts past that).
    blocks = sum(-(-held // b) for kind, b, _, _, _ in groups if kind == "full_attention")
    num_blocks = int(blocks * 1.3) + 8 * (work.max_tokens // 64)
    manager = build_kv_cache_manager(
        geometry, num_blocks, max_model_len=work.max_tokens + 8192, enable_kv_cache_events=True
    )
    engine = SimulatedEngine(geometry, manager)
    rank = engine_no % work.dp_ranks
    name = engine_name(f"http://decode-{engine_no // work.dp_ranks}:8000", rank)  # keyed as the router keys it
    trace = EngineTrace(name, rank, [], [], 0, 0, 0)
    encoder = msgspec.msgpack.Encoder()
    clock = 0.0

    def publish() -> None:
        nonlocal clock
        events = manager.take_events()
        if events:
            clock += 0.01
            trace.payloads.append(encoder.encode(KVEventBatch(ts=clock, events=events, data_parallel_rank=rank)))
            trace.events.append(len(events))
            trace.removed_blocks += sum(len(e.block_hashes) for e in events if isinstance(e, BlockRemoved))

    sent = [0] * len(conversations)  # requests served per conversation
    order = list(range(len(conversations)))
    while order:
        c = rng.choice(order)
        sent[c] += 1
        if sent[c] == len(conversations[c]):
            order.remove(c)
        prompt = array("H", system)
        for segment in conversations[c][: sent[c]]:
            prompt.extend(segment)
        tokens = prompt.tolist()
        request = engine.new_request(f"e{engine_no}c{c}t{trace.requests}", tokens)
        hit = engine.prefill(request, work.chunk, after_step=publish)
        manager.free(request)
        publish()
        trace.requests += 1
        trace.new_tokens += len(tokens) - hit
    for c in rng.sample(range(len(conversations)), min(work.probes, len(conversations))):
        probe = array("H", system)
        for segment in conversations[c]:
            probe.extend(segment)
        probe.extend(_tokens(rng, rng.randrange(500, 4000)))  # the next turn
        trace.probes.append(probe)
        _, real, _ = manager.get_computed_blocks(engine.new_request(f"probe{c}", probe.tolist()))
        trace.real_hits.append(real)
    return trace


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize()


def _slope(points: list[tuple[int, int]]) -> float:
    """Least-squares slope of y over x."""
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    den = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / den if den else float("nan")


def _pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_geometry(geometry_name: str, work: Workload, pool: concurrent.futures.Executor) -> dict[str, Any]:
    """Record and ingest every engine core of one geometry, then time the probes' lookups."""
    groups = parse_groups(GEOMETRIES[geometry_name][1])
    indexes: dict[str, EngineKVIndex] = {}
    probes: list[tuple[str, array[int], int]] = []
    ingest_s = rebuild_s = ingest_wall_s = 0.0
    events = batches = requests = new_tokens = removed = replayed = 0
    above: list[str] = []
    recovered = predicted_after = held_hit = 0
    memory: list[tuple[int, int]] = []
    gc.collect()
    base_rss = _rss_bytes()
    for engine_no in range(work.engines):
        trace = pool.submit(record_engine, geometry_name, engine_no, work).result()
        index = indexes[trace.name] = EngineKVIndex(engine=trace.name, dp_rank=trace.dp_rank)
        start, wall = time.thread_time(), time.perf_counter()
        for payload in trace.payloads:  # the real ingest path: what `KVEventsFeed` calls per batch
            index.apply_payload(payload)
        ingest_s += time.thread_time() - start
        ingest_wall_s += time.perf_counter() - wall
        events += sum(trace.events)
        batches += len(trace.payloads)
        requests += trace.requests
        new_tokens += trace.new_tokens
        removed += trace.removed_blocks
        # A router joining now: the engine replays only its last `replay_steps` batches.
        late = EngineKVIndex(engine=trace.name, dp_rank=trace.dp_rank)
        start = time.thread_time()
        for payload in trace.payloads[-work.replay_steps :]:
            late.apply_payload(payload)
        rebuild_s += time.thread_time() - start
        replayed += sum(trace.events[-work.replay_steps :])
        for tokens, real in zip(trace.probes, trace.real_hits):
            after = predicted_hits(groups, late, RoutingPrompt(tokens.tolist()))[0]
            if after > real:
                above.append(f"{trace.name}: after restart predicted {after}, vLLM {real}")
            recovered += after == real
            predicted_after += after
            held_hit += real
            probes.append((trace.name, tokens, real))
        del trace, late
        gc.collect()
        memory.append((sum(i.budget.held for i in indexes.values()), _rss_bytes()))
        if work.engines >= 16 and (engine_no + 1) % 8 == 0:  # progress of a long run
            print(
                f"  [{geometry_name}] {engine_no + 1} cores: {events / ingest_s:,.0f} events/s,"
                f" {memory[-1][0]:,} blocks, RSS {memory[-1][1] / 2**20:,.0f} MiB",
                flush=True,
            )
    published = events / requests * work.requests_per_s * work.engines
    return {
        "geometry": geometry_name,
        "engines": work.engines,
        "conversations_per_engine": work.conversations,
        "requests": requests,
        "batches": batches,
        "events": events,
        "new_tokens": new_tokens,
        "removed_blocks": removed,
        "ingest_s": ingest_s,  # CPU time of the ingesting thread: one core's work
        "ingest_wall_s": ingest_wall_s,  # on a shared machine, includes waiting for a core
        "ingest_events_per_s": events / ingest_s,
        "ingest_tokens_per_s": new_tokens / ingest_s,
        "events_per_request": events / requests,
        "new_tokens_per_request": new_tokens / requests,
        "published_events_per_s": published,
        "ingest_over_publish": (events / ingest_s) / published,
        # The request rate per core at which 64 cores publish what one core ingests.
        "break_even_requests_per_s": events / ingest_s / (events / requests) / work.engines,
        "held_blocks": memory[-1][0],
        "rss_base_bytes": base_rss,
        "rss_bytes": memory[-1][1],
        # Past the first quarter: the allocator's arenas are warm by then.
        "bytes_per_block": _slope(memory[len(memory) // 4 :]) if len(memory) > 2 else float("nan"),
        "memory_points": memory,
        "rebuild_s_all_engines": rebuild_s,
        "replayed_events": replayed,
        "restart_above_vllm": above,
        "restart_exact": recovered,
        "restart_hit_share": predicted_after / held_hit if held_hit else float("nan"),  # of vLLM's hit tokens
        **_lookups(indexes, probes, groups),
    }


def _lookups(
    indexes: dict[str, EngineKVIndex], probes: list[tuple[str, array[int], int]], groups: Any
) -> dict[str, Any]:
    """Each probe as one request through the router's lookup path, over every engine core."""
    totals: list[float] = []  # CPU time of the thread: the request's work on one core
    on_loop: list[float] = []
    walls: list[float] = []  # wall time: the same plus waiting for a core on a shared machine
    wrong: list[str] = []
    grains = {i.granularity for i in indexes.values()} - {0}
    for owner, tokens, real in probes:
        seq = tokens.tolist()
        wall, start = time.perf_counter(), time.thread_time()
        prompt = RoutingPrompt(seq)
        prompt.fill(grains)  # `KVEventsFeed.fill_keys`, off the loop
        filled = time.thread_time()
        best, best_hit = None, 0
        for name, index in indexes.items():  # the kv-aware policy: every engine core
            hit = index.hit_tokens(prompt)
            if hit > best_hit:
                best, best_hit = name, hit
        chosen = indexes[best or owner]
        predicted = -1 if chosen.unplaced_in(prompt) else predicted_hits(groups, chosen, prompt)[0]  # the decider
        end = time.thread_time()
        walls.append((time.perf_counter() - wall) * 1e3)
        totals.append((end - start) * 1e3)
        on_loop.append((end - filled) * 1e3)
        if best != owner:  # a tie below the owner's hit (the shared system prompt) may pick another core
            predicted = predicted_hits(groups, indexes[owner], prompt)[0]
        if predicted != real:
            wrong.append(f"{owner}: predicted {predicted}, vLLM {real}")
    return {
        "probes": len(probes),
        "lookup_p50_ms": _pct(totals, 0.5),
        "lookup_p99_ms": _pct(totals, 0.99),
        "on_loop_p50_ms": _pct(on_loop, 0.5),
        "on_loop_p99_ms": _pct(on_loop, 0.99),
        "wall_p50_ms": _pct(walls, 0.5),
        "wall_p99_ms": _pct(walls, 0.99),
        "probe_tokens_mean": statistics.fmean(len(t) for _, t, _ in probes),
        "mispredicted": wrong,
    }


def main(argv: list[str] | None = None) -> int:
    defaults = Workload()
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fleet", description=__doc__)
    for name, value in asdict(defaults).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--geometry", nargs="+", choices=list(GEOMETRIES), default=list(GEOMETRIES))
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    work = Workload(**{name: getattr(args, name) for name in asdict(defaults)})
    rows: list[dict[str, Any]] = []
    if len(args.geometry) > 1:
        # One process per geometry: the resident set of one says nothing once another's
        # indexes were freed into the allocator's arenas.
        with tempfile.TemporaryDirectory() as tmp:
            for name in args.geometry:
                out = Path(tmp) / f"{name}.json"
                workload = [
                    str(a) for field, value in asdict(work).items() for a in (f"--{field.replace('_', '-')}", value)
                ]
                command = [sys.executable, "-m", "benchmarks.fleet", *workload, "--geometry", name, "--json", str(out)]
                subprocess.run(command, check=False)
                rows += json.loads(out.read_text())["rows"] if out.exists() else []
                _write(args.json, work, rows)
        ok = len(rows) == len(args.geometry)
    else:
        # The recorder imports vLLM and holds a manager: a child process, so that the router
        # process's resident set is the index's.
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
            rows.append(run_geometry(args.geometry[0], work, pool))
        _print(rows[0], work)
        _write(args.json, work, rows)
        ok = True
    return 0 if ok and not any(r["mispredicted"] or r["restart_above_vllm"] for r in rows) else 1


def _write(path: str | None, work: Workload, rows: list[dict[str, Any]]) -> None:
    if path:  # after each geometry: a long run's first rows survive an interruption
        with open(path, "w") as fh:
            json.dump({"workload": asdict(work), "rows": rows}, fh, indent=2)


def _print(row: dict[str, Any], work: Workload) -> None:
    print(
        f"{row['geometry']}: {work.engines} engine cores x {work.conversations} conversations "
        f"({work.min_tokens}-{work.max_tokens} tokens), {row['requests']} requests, {row['batches']} batches"
    )
    print(
        f"  ingest: {row['events']} events ({row['new_tokens'] / 1e6:.1f}M new tokens)"
        f" in {row['ingest_s']:.2f} CPU s ({row['ingest_wall_s']:.2f} s wall) on one core:"
        f" {row['ingest_events_per_s']:,.0f} events/s, {row['ingest_tokens_per_s'] / 1e6:.2f}M tokens/s"
    )
    print(
        f"  publish at {work.requests_per_s:g} requests/s per core ({row['events_per_request']:.1f} events,"
        f" {row['new_tokens_per_request']:,.0f} new tokens each): {row['published_events_per_s']:,.0f} events/s;"
        f" ingest/publish = {row['ingest_over_publish']:.2f}"
        f" (break-even at {row['break_even_requests_per_s']:.1f} requests/s per core)"
    )
    print(
        f"  lookup per request over {work.engines} cores"
        f" ({row['probes']} probes, {row['probe_tokens_mean']:,.0f} tokens mean):"
        f" p50 {row['lookup_p50_ms']:.2f} ms, p99 {row['lookup_p99_ms']:.2f} ms"
        f" (on the loop: p50 {row['on_loop_p50_ms']:.2f}, p99 {row['on_loop_p99_ms']:.2f}; CPU time)"
        f"; wall p50 {row['wall_p50_ms']:.2f}, p99 {row['wall_p99_ms']:.2f}"
    )
    print(
        f"  memory: {row['held_blocks']:,} blocks held, RSS {row['rss_bytes'] / 2**20:,.0f} MiB"
        f" (base {row['rss_base_bytes'] / 2**20:,.0f}); {row['bytes_per_block']:.0f} bytes per cached block"
    )
    print(
        f"  restart with {work.replay_steps} replayed batches per core:"
        f" rebuilt in {row['rebuild_s_all_engines']:.2f} CPU s"
        f" ({row['replayed_events']} events); {row['restart_exact']}/{row['probes']} probes exact"
        f" ({row['restart_hit_share']:.0%} of vLLM's hit tokens predicted),"
        f" {len(row['restart_above_vllm'])} above vLLM; mispredicted before restart: {len(row['mispredicted'])}"
    )
    for line in row["mispredicted"][:5] + row["restart_above_vllm"][:5]:
        print("   ", line)


if __name__ == "__main__":
    sys.exit(main())
