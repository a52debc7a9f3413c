"""Usage the client sees: prompt accounting from prefill, output from decode, in whole
answers and in streams cut at arbitrary byte boundaries."""

from __future__ import annotations

import json

from pdconnect.router.usage import SseRewriter, UsageMerger, failure_pattern

PREFILL = {
    "prompt_tokens": 127,
    "completion_tokens": 1,
    "total_tokens": 128,
    "prompt_tokens_details": {"cached_tokens": 64},
}


def merger() -> UsageMerger:
    made = UsageMerger.from_prefill(PREFILL)
    assert made is not None
    return made


def decode_usage() -> dict[str, object]:
    # What a decode engine says: the transferred prompt looks fully cached.
    return {
        "prompt_tokens": 127,
        "completion_tokens": 8,
        "total_tokens": 135,
        "prompt_tokens_details": {"cached_tokens": 127},
    }


def test_merge_takes_prompt_side_from_prefill_and_output_from_decode() -> None:
    usage = decode_usage()
    merger().merge(usage)
    assert usage == {
        "prompt_tokens": 127,
        "completion_tokens": 8,
        "total_tokens": 135,
        "prompt_tokens_details": {"cached_tokens": 64},
    }


def test_decode_cache_claim_is_dropped_when_prefill_reports_no_details() -> None:
    usage = decode_usage()
    merger = UsageMerger.from_prefill({"prompt_tokens": 127, "completion_tokens": 1})
    assert merger is not None
    merger.merge(usage)
    assert "prompt_tokens_details" not in usage


def test_no_merger_without_prefill_usage() -> None:
    assert UsageMerger.from_prefill(None) is None
    assert UsageMerger.from_prefill({"completion_tokens": 1}) is None


def test_body_without_usage_passes_unchanged() -> None:
    body = b'{"choices": []}'
    assert merger().rewrite_body(body) is body
    assert merger().rewrite_body(b"not json") == b"not json"


def test_stream_split_anywhere_gives_the_same_events_with_merged_usage() -> None:
    events = [
        {"choices": [{"index": 0, "text": " a"}]},
        {"choices": [{"index": 0, "text": " b"}], "usage": None},
        {"choices": [], "usage": decode_usage()},
    ]
    stream = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    for cut in range(1, 40):
        rewriter = SseRewriter(merger())
        out = b"".join(rewriter.feed(stream[i : i + cut]) for i in range(0, len(stream), cut)) + rewriter.flush()
        blocks = out.decode().split("\n\n")
        assert blocks[-2:] == ["data: [DONE]", ""]
        parsed = [json.loads(b[6:]) for b in blocks[:-2]]
        assert parsed[:2] == events[:2]
        assert parsed[2]["usage"]["prompt_tokens_details"] == {"cached_tokens": 64}
        assert parsed[2]["usage"]["completion_tokens"] == 8


def test_events_without_usage_are_passed_as_bytes() -> None:
    rewriter = SseRewriter(merger())
    chunk = b'data: {"choices":[{"text":" x"}]}\n\n'
    assert rewriter.feed(chunk) is chunk


def test_a_failure_event_is_found_wherever_the_stream_is_cut() -> None:
    """`failed`: whether a whole event so far held one of the given failure marks (an
    engine's error event); a mark cut across two reads counts once its event is whole,
    and the same text inside an ordinary event's string does not count."""
    ok = b'data: {"choices":[{"text":"data: {\\"error\\":"}]}\n\n'
    error = b'data: {"error":{"message":"refused","code":500}}\n\n'
    marks = failure_pattern(b'data: {"error":', b"event: error\n")
    for stream, failed in ((ok + b"data: [DONE]\n\n", False), (ok + error + b"data: [DONE]\n\n", True)):
        for cut in range(1, 30):
            rewriter = SseRewriter(None, failed=marks)
            seen = []
            for i in range(0, len(stream), cut):
                rewriter.feed(stream[i : i + cut])
                seen.append(rewriter.failed)
            assert seen[-1] is failed and rewriter.complete
            assert not any(seen[: len(ok) // cut - 1])  # nothing before the error event
