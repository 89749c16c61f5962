"""Progress bars for long data and bench work that also report when nobody is watching.

Rich draws a live bar only on a terminal; under ``nohup``, a scheduler or CI, where stderr is a
file, its bar stays silent until the work ends, so a 45-minute feature caching run leaves no
trace of its pace. :func:`progress_bar` returns the Rich bar on a terminal and otherwise a
:class:`PlainProgress` that writes one line every ``interval`` seconds (and one at the end) with
the count, the rate and an estimate of the time left. Both offer the part of Rich's API the
callers use: ``add_task(description, total=..., **fields)`` and
``update(task, advance=..., description=..., **fields)``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

__all__ = ["PlainProgress", "progress_bar", "format_seconds"]


def format_seconds(seconds: float) -> str:
    """``75`` -> ``"1m15s"``; ``3725`` -> ``"1h02m05s"`` (log lines stay short)."""
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


@dataclass
class _Task:
    description: str
    total: float | None
    completed: float = 0.0
    fields: dict[str, Any] = field(default_factory=dict)
    reported_done: bool = False


class PlainProgress:
    """A progress report as plain lines, for streams that are not terminals.

    Args:
        label: Bold label of the Rich bar (e.g. ``"caching features"``), the line's prefix.
        unit: Unit of a ``rate`` field, shown after it (``"tok/s"``); None hides the rate.
        stream: Where lines go (default: ``sys.stderr`` at write time).
        interval: Seconds between two lines while the work runs.
        clock: Monotonic clock, injectable for tests.
    """

    def __init__(
        self,
        label: str,
        *,
        unit: str | None = None,
        stream: TextIO | None = None,
        interval: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if interval <= 0:
            raise ValueError("PlainProgress: interval must be positive")
        self.label = label
        self.unit = unit
        self.stream = stream
        self.interval = interval
        self.clock = clock
        self.tasks: list[_Task] = []
        self._start = clock()
        self._last = self._start

    def __enter__(self) -> PlainProgress:
        self._start = self._last = self.clock()
        return self

    def __exit__(self, *exc: object) -> None:
        for task in self.tasks:
            if not task.reported_done and task.completed > 0:
                self._write(task)

    def add_task(self, description: str, total: float | None = None, **fields: Any) -> int:
        self.tasks.append(_Task(description, total, fields=dict(fields)))
        return len(self.tasks) - 1

    def update(
        self,
        task_id: int,
        *,
        advance: float = 0.0,
        description: str | None = None,
        **fields: Any,
    ) -> None:
        task = self.tasks[task_id]
        task.completed += advance
        if description is not None:
            task.description = description
        task.fields.update(fields)
        now = self.clock()
        finished = task.total is not None and task.completed >= task.total
        if finished and not task.reported_done:
            task.reported_done = True
            self._write(task)
        elif not finished and now - self._last >= self.interval:
            self._write(task)

    def line(self, task: _Task) -> str:
        """The report of ``task`` now: count, percentage, rate, elapsed and time left."""
        elapsed = self.clock() - self._start
        done = int(task.completed)
        parts = [f"{self.label} {task.description}:"]
        if task.total:
            parts.append(f"{done}/{int(task.total)} ({100.0 * task.completed / task.total:.0f}%)")
        else:
            parts.append(str(done))
        rate = task.fields.get("rate")
        if self.unit is not None and rate is not None:
            parts.append(f"{float(rate):.1f} {self.unit}")
        parts.append(f"elapsed {format_seconds(elapsed)}")
        if task.total and 0 < task.completed < task.total:
            left = elapsed * (task.total - task.completed) / task.completed
            parts.append(f"left ~{format_seconds(left)}")
        return " ".join(parts)

    def _write(self, task: _Task) -> None:
        self._last = self.clock()
        stream = self.stream if self.stream is not None else sys.stderr
        print(self.line(task), file=stream, flush=True)


def progress_bar(
    label: str,
    *,
    enabled: bool = True,
    unit: str | None = None,
    interval: float = 30.0,
) -> Any:
    """A Rich progress bar on a terminal, :class:`PlainProgress` lines elsewhere.

    ``unit`` names the ``rate`` field a caller passes to ``update`` (``"tok/s"``); disabled, the
    Rich bar is returned with ``disable=True`` (a no-op with the same API).
    """
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    console = Console(stderr=True)
    if enabled and not console.is_terminal:
        return PlainProgress(label, unit=unit, interval=interval)
    columns: list[Any] = [
        TextColumn(f"[bold]{label}[/bold] {{task.description}}"),
        BarColumn(),
        MofNCompleteColumn(),
    ]
    if unit is not None:
        columns.append(TextColumn(f"{{task.fields[rate]:>8.1f}} {unit}"))
    columns += [TimeElapsedColumn(), TimeRemainingColumn()]
    return Progress(*columns, console=console, disable=not enabled)
