"""Plain progress lines for non-terminal streams (nohup logs, CI), on a fake clock."""

from __future__ import annotations

import io

import pytest
from rich.progress import Progress

from lightning_spec.progress import PlainProgress, format_seconds, progress_bar


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_format_seconds() -> None:
    assert format_seconds(7.4) == "7s"
    assert format_seconds(75) == "1m15s"
    assert format_seconds(3725) == "1h02m05s"
    assert format_seconds(-3) == "0s"


def test_plain_progress_writes_every_interval_and_once_at_the_end() -> None:
    clock, stream = FakeClock(), io.StringIO()
    with PlainProgress(
        "caching features", unit="tok/s", stream=stream, interval=30, clock=clock
    ) as bar:
        task = bar.add_task("conversations", total=100, rate=0.0)
        clock.now += 10
        bar.update(task, advance=10, rate=370.0)  # 10 s since start: too soon for a line
        assert stream.getvalue() == ""
        clock.now += 20
        bar.update(task, advance=15, rate=365.25)  # 30 s: 25/100 done
        clock.now += 5
        bar.update(task, advance=5)  # 5 s after the last line: silent
        clock.now += 55
        bar.update(task, advance=70, rate=360.0)  # finished: its line comes at once
    lines = stream.getvalue().splitlines()
    # 25 done in 30 s, 75 left at the same pace: 90 s left.
    assert lines[0] == (
        "caching features conversations: 25/100 (25%) 365.2 tok/s elapsed 30s left ~1m30s"
    )
    assert lines[1] == "caching features conversations: 100/100 (100%) 360.0 tok/s elapsed 1m30s"
    assert len(lines) == 2  # the context exit does not repeat a finished task


def test_plain_progress_reports_unfinished_work_on_exit_and_follows_the_description() -> None:
    clock, stream = FakeClock(), io.StringIO()
    with PlainProgress("bench", stream=stream, interval=30, clock=clock) as bar:
        task = bar.add_task("prompts", total=40)
        clock.now += 12
        bar.update(task, advance=3, description="mtbench 3")
    # Stopped early (an exception, a budget): one line says how far it got; no rate without unit.
    assert stream.getvalue() == "bench mtbench 3: 3/40 (8%) elapsed 12s left ~2m28s\n"


def test_plain_progress_without_total_and_bad_interval() -> None:
    clock, stream = FakeClock(), io.StringIO()
    with PlainProgress("rendering", stream=stream, interval=1, clock=clock) as bar:
        task = bar.add_task("conversations")
        clock.now += 2
        bar.update(task, advance=4)
    assert stream.getvalue().splitlines()[0] == "rendering conversations: 4 elapsed 2s"
    with pytest.raises(ValueError, match="interval"):
        PlainProgress("x", interval=0)


def test_progress_bar_is_plain_off_a_terminal_and_rich_when_disabled() -> None:
    # Under pytest stderr is captured (not a terminal): plain lines.
    assert isinstance(progress_bar("caching features", unit="tok/s"), PlainProgress)
    disabled = progress_bar("caching features", enabled=False, unit="tok/s")
    assert isinstance(disabled, Progress) and disabled.disable
