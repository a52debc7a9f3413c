"""`make bench-decider`: its pure pieces (what a turn's row says, the full-attention-only count,
the ratios) without engines, and the whole benchmark at its tiny size on real engines."""

from __future__ import annotations

import math

import pytest

from benchmarks.decider import Request, format_turns, main, ratio, summarize

DELTA = {"prefill_queries": 1200.0, "prefill_hits": 200.0, "pulled": 768.0, "decode_hits": 256.0, "mispredicted": 0.0}


def _request(route: str, prompt: int, hit: int, full_attention_hit: int) -> Request:
    fields = {
        "route": route,
        "reason": "cached" if route == "decode-first" else "uncached",
        "prompt": str(prompt),
        "hit": str(hit),
        "full_attention_hit": str(full_attention_hit),
    }
    return Request(ttft_s=0.1, gaps_s=[0.01, 0.03], route=fields)


def test_a_turn_counts_routes_and_what_a_full_attention_only_decider_would_have_missed() -> None:
    requests = [
        _request("decode-first", 600, 512, 512),  # both deciders go local: 88 uncached
        _request("pd", 700, 0, 512),  # full attention alone says 188 uncached: local, but decode holds nothing
        _request("pd", 1000, 0, 0),  # nothing cached for either
    ]
    turn = summarize("on", "chat", 2, requests, DELTA, threshold=256)
    assert (turn.local, turn.full_attention_local, turn.full_attention_missed) == (1, 2, 1)
    assert (turn.prefill_computed, turn.pulled, turn.decode_hit) == (1000.0, 768.0, 256.0)
    assert turn.itl_p50_s == pytest.approx(0.02)
    # A request the router did not predict for (no events yet) counts for neither.
    quiet = summarize("on", "chat", 1, [Request(0.2, [], {"route": "pd", "reason": "no_events"})], DELTA, 256)
    assert (quiet.full_attention_local, quiet.local) == (0, 0) and math.isnan(quiet.itl_p99_s)
    table = format_turns([turn, quiet])
    assert "2 (1)" in table and "1/3" in table


def test_ratios_say_when_there_is_nothing_to_divide() -> None:
    assert ratio(1.0, 4.0) == "0.25x" and ratio(0.0, 0.0) == "-" and ratio(1.0, 0.0) == "inf"


@pytest.mark.engine
def test_the_benchmark_runs_at_its_tiny_size_with_no_misprediction(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--tiny"]) == 0
    out = capsys.readouterr().out
    assert "ratios, on / off" in out and "local prefill tokens" in out
