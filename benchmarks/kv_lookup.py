"""`make bench-lookup`: the router's kv-aware lookup per engine, beside tokenizing the same prompt.

For each prompt length and geometry, an engine index holds the whole prompt in its full
attention group(s), and the sliding group misses the window right below the end (the hit
lands a few windows back: the case that made the former lookup quadratic). Timed, in one
run, interleaved: one lookup that computes the prompt's chain keys (the first engine of a
request), one that reuses them (every further engine), a miss, and the local tiny model's
tokenizer on a text of the same token count.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from pdconnect.router.kvindex import EngineKVIndex, GroupIndex
from pdconnect.router.prompt import RoutingPrompt, block_keys

GEOMETRIES: dict[str, tuple[tuple[int, int | None], ...]] = {
    "FA16+SWA16/w128": ((16, None), (16, 128)),
    "FA64+SWA64/w128": ((64, None), (64, 128)),
    "FA64+FA64+SWA256/w512": ((64, None), (64, None), (256, 512)),
    "FA256+2xSWA64/w128": ((256, None), (64, 128), (64, 128)),  # MiMo-V2-like: keys at 64
}


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def warm_index(geometry: tuple[tuple[int, int | None], ...], tokens: list[int]) -> EngineKVIndex:
    """Full attention holds every block; sliding groups miss every other block of the last 8 windows."""
    index = EngineKVIndex()
    grain = math.gcd(*(size for size, _ in geometry))  # the engine's key space
    for gid, (size, window) in enumerate(geometry):
        keys = block_keys(tokens, size, grain)
        if window is not None:
            gap = 8 * -(-window // size)
            cut = max(0, len(keys) - gap)
            keys = keys[:cut] + keys[cut + 1 :: 2]  # every other block: no window fits above `cut`
        index.groups[gid] = GroupIndex(size, window, present=dict.fromkeys(keys, 1))
    return index


def _tokenizer(path: str | None) -> object | None:
    from tokenizers import Tokenizer

    candidates = [Path(path)] if path else sorted(Path("build/models").glob("hybrid-llama-*/tokenizer.json"))
    return Tokenizer.from_file(str(candidates[0])) if candidates and candidates[0].exists() else None


def _text_of(tokenizer: object, n: int) -> str:
    """A text of `n` words drawn from the tokenizer's vocabulary (one token each for the
    tiny model's word-level tokenizer; a few more per word for a real BPE one)."""
    rng = random.Random(n)
    vocab = sorted(w for w in tokenizer.get_vocab() if w.isalnum())  # type: ignore[attr-defined]  # a transformers tokenizer, typed object: no torch here
    return " ".join(rng.choice(vocab) for _ in range(n))


def measure(
    name: str,
    geometry: tuple[tuple[int, int | None], ...],
    tokens: list[int],
    text: str | None,
    tokenizer: object | None,
    repeats: int,
) -> dict[str, object]:
    """One row: the lookup three ways and the tokenizer, interleaved over five rounds."""
    index = warm_index(geometry, tokens)
    shared = RoutingPrompt(tokens)
    index.hit_tokens(shared)
    cold = EngineKVIndex(groups={gid: GroupIndex(g.block_size, g.sliding_window) for gid, g in index.groups.items()})
    timed: dict[str, Callable[[], object]] = {
        "first_ms": lambda: index.hit_tokens(RoutingPrompt(tokens)),  # the request's first engine computes the keys
        "next_ms": lambda: index.hit_tokens(shared),  # every further engine reuses them
        "miss_ms": lambda: cold.hit_tokens(RoutingPrompt(tokens)),
    }
    if text is not None and tokenizer is not None:
        timed["tokenize_ms"] = lambda: tokenizer.encode(text)  # type: ignore[attr-defined]  # as above
    rounds: dict[str, list[float]] = {column: [] for column in timed}
    for _ in range(5):  # interleaved rounds: drift on the machine hits all columns alike
        for column, fn in timed.items():
            rounds[column].append(_median_ms(fn, max(1, repeats // 5)))
    hit = index.hit_tokens(RoutingPrompt(tokens))
    row: dict[str, object] = {"geometry": name, "tokens": len(tokens), "hit_tokens": hit}
    row |= {column: statistics.median(samples) for column, samples in rounds.items()}
    row.setdefault("tokenize_ms", None)
    return row


def run(lengths: list[int], repeats: int, tokenizer_path: str | None) -> list[dict[str, object]]:
    tokenizer = _tokenizer(tokenizer_path)
    rows: list[dict[str, object]] = []
    print(f"kv-aware lookup per engine (median of {repeats}); tokenizer = build/models' tiny hybrid Llama's")
    print(
        f"{'geometry':<24}{'tokens':>8}{'hit':>8}{'first ms':>10}{'next ms':>9}{'miss ms':>9}"
        f"{'tokenize ms':>13}{'first/tok':>11}"
    )
    for n in lengths:
        tokens = [random.Random(n).randrange(1, 120_000) for _ in range(n)]
        text = _text_of(tokenizer, n) if tokenizer is not None else None
        for name, geometry in GEOMETRIES.items():
            row = measure(name, geometry, tokens, text, tokenizer, repeats)
            ratio = row["first_ms"] / row["tokenize_ms"] if row["tokenize_ms"] else None  # type: ignore[operator]  # row values are float | str
            row["first_over_tokenize"] = ratio
            rows.append(row)
            print(
                f"{name:<24}{n:>8}{row['hit_tokens']:>8}{row['first_ms']:>10.2f}{row['next_ms']:>9.2f}"
                f"{row['miss_ms']:>9.3f}{row['tokenize_ms'] or float('nan'):>13.2f}"
                f"{ratio if ratio is not None else float('nan'):>11.3f}"
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kv_lookup", description=__doc__)
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--tokenizer", help="a tokenizer.json (default: the tiny hybrid Llama's in build/models)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    rows = run(args.tokens, args.repeats, args.tokenizer)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": rows}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
