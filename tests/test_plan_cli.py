"""`pdconnect plan`: the operator's view of a request's plan, and its refusal of bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from connectors.plan_cli import main

WORKED_EXAMPLE = ["--fa-block-size", "256", "--swa-block-size", "64", "--window", "128", "--prompt-tokens", "5131"]


def test_installed_command_prints_the_worked_example_as_json():
    out = subprocess.run(
        [sys.executable, "-m", "pdconnect.cli", "plan", *WORKED_EXAMPLE, "--eagle", "--json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    report = json.loads(out)
    assert report["expected_sibling_hit_tokens"] == 4864
    swa = next(g for g in report["groups"] if g["kind"] == "sliding_window")
    assert swa["slack_blocks"] == [74, 75, 76]
    assert swa["tail_blocks"] == [78, 79, 80]
    assert swa["transfer_blocks"] == [74, 75, 76, 78, 79, 80]
    assert swa["publish_blocks"] == [74, 75, 76]
    fa = next(g for g in report["groups"] if g["kind"] == "full_attention")
    assert fa["block_size"] == 256 and fa["transfer_blocks"] == list(range(21))
    assert report["stock_sibling_hit_tokens"] == 0


def test_no_eagle_moves_no_slack_for_5131_but_does_for_5376(capsys):
    assert main([*WORKED_EXAMPLE, "--no-eagle", "--json"]) == 0
    swa = json.loads(capsys.readouterr().out)["groups"][1]
    assert swa["slack_blocks"] == []
    args = [a if a != "5131" else "5376" for a in WORKED_EXAMPLE]
    assert main([*args, "--no-eagle", "--json"]) == 0
    swa = json.loads(capsys.readouterr().out)["groups"][1]
    assert swa["slack_blocks"] == [78, 79] and swa["tail_blocks"] == [82, 83]


def test_table_output_names_groups_and_the_sibling_hit(capsys):
    assert main(WORKED_EXAMPLE) == 0
    out = capsys.readouterr().out
    assert "sliding_window" in out and "74-76" in out and "4864 tokens" in out


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--window", "0", "--window must be positive"),
        ("--window", "-5", "--window must be positive"),
        ("--swa-block-size", "0", "--swa-block-size must be positive"),
        ("--fa-block-size", "-256", "--fa-block-size must be positive"),
        ("--prompt-tokens", "100", "shorter than one block"),
        ("--window", "abc", "invalid int value"),
    ],
)
def test_bad_arguments_give_one_line_and_exit_code_2(flag, value, message):
    args = list(WORKED_EXAMPLE)
    args[args.index(flag) + 1] = value
    result = subprocess.run(
        [sys.executable, "-m", "pdconnect.cli", "plan", *args], check=False, capture_output=True, text=True
    )
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]


def _real_plan(groups, prompt_tokens):
    """What vLLM's real coordinator and the planner give for a hand-written geometry."""
    from connectors.plan_cli import plan_as_dict
    from connectors.replay_slack import plan_request
    from connectors.vllm_adapter import CacheRules, Geometry

    rules = CacheRules.for_geometry(Geometry(tuple(groups)))
    plan = plan_request(rules, prompt_tokens, expected_hits=True)
    stock = plan_request(rules, prompt_tokens, replay_slack=False, expected_hits=True)
    return plan_as_dict(plan, stock)


def _run_json(capsys, args):
    assert main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_repeated_group_flags_give_the_worked_example(capsys):
    report = _run_json(capsys, ["--group", "full:256", "--group", "sliding:64:128", "--prompt-tokens", "5131"])
    assert report["expected_sibling_hit_tokens"] == 4864
    assert [g["kind"] for g in report["groups"]] == ["full_attention", "sliding_window"]
    assert report["groups"][1]["slack_blocks"] == [74, 75, 76]


def test_any_number_of_groups_including_an_uncached_window(capsys):
    """DeepSeek-V4.1: a second, bounded-replay window vLLM does not prefix-cache."""
    from connectors.vllm_adapter import GroupGeometry

    args = [
        "--group",
        "full:256",
        "--group",
        "sliding:64:128",
        "--group",
        "sliding:64:128:uncached",
        "--group",
        "sliding:32:64",
        "--prompt-tokens",
        "5131",
    ]
    report = _run_json(capsys, args)
    expected = _real_plan(
        [
            GroupGeometry("full_attention", 256, eagle=True),
            GroupGeometry("sliding_window", 64, 128, eagle=True),
            GroupGeometry("sliding_window", 64, 128, eagle=True, prefix_cacheable=False),
            GroupGeometry("sliding_window", 32, 64, eagle=True),
        ],
        5131,
    )
    assert report == expected
    assert len(report["groups"]) == 4 and report["groups"][2]["publish_blocks"] == []


def _dsv4_style_config(path):
    """A DeepSeek-V4-style config: sliding and full layers whose KV shapes differ (4x the
    bytes per token in the sliding layers), window 128, one MTP layer."""
    layer_types = ["sliding_attention", "full_attention"] * 3
    config = {
        "model_type": "deepseek_v4_style",
        "num_hidden_layers": 6,
        "layer_types": layer_types,
        "sliding_window": 128,
        "num_attention_heads": 8,
        "num_key_value_heads": 1,
        "head_dim": 128,
        "swa_num_key_value_heads": 2,
        "swa_head_dim": 256,
        "num_nextn_predict_layers": 1,
    }
    path.write_text(json.dumps(config))
    return path


def test_deepseek_v4_style_config_plans_as_its_engine_geometry(tmp_path, capsys):
    from connectors.vllm_adapter import GroupGeometry

    config = _dsv4_style_config(tmp_path / "config.json")
    report = _run_json(capsys, ["--config", str(config), "--block-size", "64", "--prompt-tokens", "5131"])
    # The engine's --block-size 64 gives the sliding layers 64-token blocks, the full
    # layers (a quarter of the bytes per token) 256; the MTP layer turns EAGLE on.
    expected = _real_plan(
        [
            GroupGeometry("sliding_window", 64, 128, eagle=True),
            GroupGeometry("full_attention", 256, eagle=True),
        ],
        5131,
    )
    assert report == expected
    assert report["expected_sibling_hit_tokens"] == 4864


@pytest.mark.parametrize(
    ("spec", "block_size", "prompt", "groups"),
    [
        # test_connector_engines.py: a real engine on `--block-size 64` reports groups of 64
        # (sliding, window 128) and 256 tokens for this model; its MTP layer means EAGLE.
        ("dsv4-mimo", 64, 5131, [("sliding_window", 64, 128, True), ("full_attention", 256, None, True)]),
        ("hybrid-llama", 16, 300, [("sliding_window", 16, 64, False), ("full_attention", 16, None, False)]),
    ],
)
def test_tiny_model_configs_plan_as_their_engine_geometry(tmp_path, capsys, spec, block_size, prompt, groups):
    from connectors.vllm_adapter import GroupGeometry
    from pdconnect.testbed.tinymodel import DSV4_LIKE_MIMO_V2, TinyModelSpec, ensure_model

    model = DSV4_LIKE_MIMO_V2 if spec == "dsv4-mimo" else TinyModelSpec(kind="hybrid-llama")
    model_dir = ensure_model(model, tmp_path / spec)
    args = ["--config", str(model_dir / "config.json"), "--block-size", str(block_size), "--prompt-tokens", str(prompt)]
    report = _run_json(capsys, args)
    assert report == _real_plan([GroupGeometry(k, b, w, eagle=e) for k, b, w, e in groups], prompt)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--group", "full:256", "--group", "sliding:64"], "expected full:BLOCK or sliding:BLOCK:WINDOW"),
        (["--group", "mamba:16"], "expected full:BLOCK or sliding:BLOCK:WINDOW"),
        (["--group", "sliding:64:x"], "must be integers"),
        (["--group", "sliding:64:0"], "window must be positive"),
        (["--group", "full:256", "--window", "128"], "describe the groups one way"),
        (["--fa-block-size", "256", "--window", "128"], "--swa-block-size required"),
        (["--config", "/nonexistent/config.json", "--block-size", "64"], "No such file"),
        (["--config", "/nonexistent/config.json"], "--config needs --block-size"),
        (["--group", "full:256", "--block-size", "64"], "--block-size goes with --config"),
        ([], "describe the groups one way"),
    ],
)
def test_bad_group_descriptions_give_one_line_and_exit_code_2(args, message):
    result = subprocess.run(
        [sys.executable, "-m", "pdconnect.cli", "plan", *args, "--prompt-tokens", "5131"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]


def test_bad_config_gives_one_line_and_exit_code_2(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]}))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdconnect.cli",
            "plan",
            "--config",
            str(bad),
            "--block-size",
            "64",
            "--prompt-tokens",
            "5131",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2 and "no sliding_window" in result.stderr


HYBRID_128 = ["--fa-block-size", "128", "--swa-block-size", "128", "--window", "64", "--prompt-tokens", "1000"]


def test_tp2_prefill_to_tp1_decode_shows_one_head_from_each_prefill_rank(capsys):
    assert main([*HYBRID_128, "--prefill-tp", "2", "--decode-tp", "1", "--kv-heads", "2", "--json"]) == 0
    tp = json.loads(capsys.readouterr().out)["tp"]
    assert tp["ranks"] == [
        {
            "decode_rank": 0,
            "groups": [
                {
                    "group": g,
                    "reads": [
                        {"prefill_rank": 0, "remote_heads": [0, 1], "local_heads": [0, 1]},
                        {"prefill_rank": 1, "remote_heads": [0, 1], "local_heads": [1, 2]},
                    ],
                }
                for g in (0, 1)
            ],
        }
    ]
    assert tp["unread_prefill_ranks"] == []


def test_tp1_prefill_to_tp2_decode_table_names_each_ranks_head_slice(capsys):
    # MiMo-V2's shape: sliding-window layers with 4 KV heads, full-attention ones with 2.
    args = ["--fa-block-size", "256", "--swa-block-size", "64", "--window", "128", "--prompt-tokens", "1000"]
    assert main([*args, "--prefill-tp", "1", "--decode-tp", "2", "--kv-heads", "2", "--swa-kv-heads", "4"]) == 0
    out = capsys.readouterr().out
    assert "prefill TP1 -> decode TP2: what each decode rank reads" in out
    assert "decode rank 1, group 0: P0 heads 1 -> heads 0" in out  # full attention: head 1 of 2
    assert "decode rank 1, group 1: P0 heads 2-3 -> heads 0-1" in out  # sliding: heads 2-3 of 4


def test_mla_decode_ranks_spread_over_prefill_ranks_and_unread_ones_are_named(capsys):
    assert (
        main(["--group", "full:256", "--prompt-tokens", "1000", "--prefill-tp", "4", "--decode-tp", "2", "--mla"]) == 0
    )
    out = capsys.readouterr().out
    assert "decode rank 0, group 0: P0 heads 0 -> heads 0" in out
    assert "decode rank 1, group 0: P2 heads 0 -> heads 0" in out
    assert "prefill ranks not read (freed when the lease ends): [1, 3]" in out


def test_a_pairing_that_cannot_work_is_refused_naming_both_sides(capsys):
    args = ["--group", "full:256", "--prompt-tokens", "1000", "--prefill-tp", "2", "--decode-tp", "1"]
    assert main([*args, "--kv-heads", "3"]) == 2
    err = capsys.readouterr().err
    assert "prefill tp_size 2 -> decode tp_size 1" in err and "3 KV heads" in err
    assert main(args) == 2
    assert "need --kv-heads" in capsys.readouterr().err
