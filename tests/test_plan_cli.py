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
