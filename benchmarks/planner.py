"""`make bench-plan`: the planner's cost per request at 64k tokens, beside one vLLM prefix-cache lookup.

Both are timed in the same run, interleaved, so the printed ratio survives a noisy
machine: the planner runs once per P/D request on the scheduler thread, next to the
lookup the scheduler already does for that request.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.planner", description=__doc__)
    parser.add_argument("--prompt-tokens", type=int, default=65_536)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args(argv)

    # Imported here: vLLM is heavy, and `pdconnect` itself never needs it.
    from connectors.geometry import Geometry, GroupGeometry
    from connectors.kvsim import SimulatedEngine, random_tokens
    from connectors.replay_slack import plan_request
    from connectors.vllm_adapter import CacheRules

    geometries = {
        "FA256/SWA64/w128": (256, 64, 128),
        "FA128/SWA32/w64": (128, 32, 64),
        "FA128/SWA32/w320": (128, 32, 320),
        "FA128/SWA128/w64 (CPU)": (128, 128, 64),
    }
    n = args.prompt_tokens
    rows = []
    print(f"planner cost per request at {n} tokens, EAGLE on (median of {args.repeats} calls each)")
    print(f"{'geometry':<24}{'plan us':>10}{'+junct us':>10}{'+hits us':>10}{'lookup us':>11}{'plan/lookup':>13}")
    for name, (fa, swa, window) in geometries.items():
        geometry = Geometry(
            (GroupGeometry("full_attention", fa, eagle=True), GroupGeometry("sliding_window", swa, window, eagle=True))
        )
        rules = CacheRules.for_geometry(geometry)
        # The reference: vLLM's own lookup for a 64k request on a warm cache holding it.
        engine = SimulatedEngine.create(geometry, n + 1)
        tokens = random_tokens(n, seed=1)
        warm = engine.new_request("warm", tokens)
        engine.prefill(warm)
        engine.free(warm)
        probe = engine.new_request("probe", tokens)

        plan_s, junction_s, hits_s, lookup_s = [], [], [], []
        for _ in range(5):  # interleave rounds so drift on the machine hits all of them alike
            plan_s.append(_median_seconds(partial(plan_request, rules, n), args.repeats // 5))
            # A sibling whose full-attention hit ran half-way past its sliding window's.
            junction_s.append(
                _median_seconds(partial(plan_request, rules, n, shared_prefix_tokens=n // 2), args.repeats // 5)
            )
            hits_s.append(
                _median_seconds(partial(plan_request, rules, n, expected_hits=True), max(1, args.repeats // 50))
            )
            lookup_s.append(_median_seconds(partial(engine.manager.get_computed_blocks, probe), args.repeats // 5))
        row: dict[str, float | str] = {
            "geometry": name,
            "plan_us": statistics.median(plan_s) * 1e6,
            "plan_with_junction_us": statistics.median(junction_s) * 1e6,
            "plan_with_expected_hits_us": statistics.median(hits_s) * 1e6,
            "lookup_us": statistics.median(lookup_s) * 1e6,
        }
        row["plan_over_lookup"] = statistics.median(plan_s) / statistics.median(lookup_s)
        rows.append(row)
        print(
            f"{name:<24}{row['plan_us']:>10.1f}{row['plan_with_junction_us']:>10.1f}"
            f"{row['plan_with_expected_hits_us']:>10.1f}"
            f"{row['lookup_us']:>11.1f}{row['plan_over_lookup']:>13.2f}"
        )
    slack = _slack_sizes(geometries)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"prompt_tokens": n, "rows": rows, "slack_sizes": slack}, fh, indent=2)
    return 0


def _slack_sizes(geometries: dict[str, tuple[int, int, int]]) -> list[dict[str, float | int | str]]:
    """Slack blocks per request over the prompt lengths the planner tests sample."""
    import random

    from connectors.geometry import Geometry, GroupGeometry
    from connectors.replay_slack import plan_request
    from connectors.vllm_adapter import CacheRules

    lengths = [5119, 5120, 5131, 5376, 5377, *random.Random(20261129).sample(range(300, 65_601), 200)]
    table = []
    print(f"\nreplay slack per request over {len(lengths)} prompt lengths (sliding-window blocks beyond the tail)")
    print(
        f"{'geometry':<24}{'EAGLE':>6}{'slack min':>11}{'slack max':>11}"
        f"{'suffix min':>12}{'suffix max':>12}{'no slack':>10}"
    )
    for name, (fa, swa, window) in geometries.items():
        for eagle in (True, False):
            rules = CacheRules.for_geometry(
                Geometry(
                    (
                        GroupGeometry("full_attention", fa, eagle=eagle),
                        GroupGeometry("sliding_window", swa, window, eagle=eagle),
                    )
                )
            )
            groups = [plan_request(rules, n).groups[1] for n in lengths]
            sizes = [len(g.slack_blocks) for g in groups]
            # The contiguous suffix P must keep: from the first slack block to the end.
            suffixes = [g.tail_blocks[-1] - (g.slack_blocks or g.tail_blocks)[0] + 1 for g in groups]
            row = {
                "geometry": name,
                "eagle": eagle,
                "slack_min": min(sizes),
                "slack_max": max(sizes),
                "suffix_min": min(suffixes),
                "suffix_max": max(suffixes),
                "share_without_slack": sum(1 for x in sizes if x == 0) / len(sizes),
            }
            table.append(row)
            print(
                f"{name:<24}{'on' if eagle else 'off':>6}{row['slack_min']:>11}{row['slack_max']:>11}"
                f"{row['suffix_min']:>12}{row['suffix_max']:>12}{row['share_without_slack']:>10.0%}"
            )
    return table


if __name__ == "__main__":
    sys.exit(main())
