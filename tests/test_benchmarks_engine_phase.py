"""How every engine benchmark's engine phase ends when it cannot finish (`benchmarks.engine_phase`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.engine_phase import engine_phase
from pdconnect.testbed.processes import StartupError

LOGS = Path("/tmp/bench-logs")


def _exit_code(raised: BaseException, *failures: type[Exception]) -> object:
    with pytest.raises(SystemExit) as stopped, engine_phase("bench-x", LOGS, *failures):
        raise raised
    return stopped.value.code


def test_ctrl_c_exits_130_and_sigterm_keeps_its_code(capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(KeyboardInterrupt()) == 130
    assert "[bench-x] interrupted: every process it started has been stopped" in capsys.readouterr().err
    assert _exit_code(SystemExit(143)) == 143
    assert _exit_code(SystemExit()) == 1  # a bare SystemExit still says it did not finish


def test_a_failure_to_start_or_measure_exits_1_naming_the_logs(capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(StartupError("engine decode-0 exited with 1")) == 1
    err = capsys.readouterr().err
    assert "[bench-x] FAILED: engine decode-0 exited with 1" in err and str(LOGS) in err
    assert _exit_code(RuntimeError("a read failed")) == 1
    assert _exit_code(ConnectionError("reset"), ConnectionError) == 1  # a benchmark's own failure kinds


def test_anything_else_is_a_bug_and_propagates() -> None:
    with pytest.raises(ValueError), engine_phase("bench-x", LOGS):
        raise ValueError("not a benchmark failure")
    with engine_phase("bench-x", LOGS):  # and a phase that ends normally raises nothing
        pass
