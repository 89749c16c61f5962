"""When the tracking store fails: which errors mean "unreachable" or "locked", and the offline
stand-in client.

The logger (`tracking/logger.py`) carries on offline only for errors that say the store could not
be reached; an error the store answered with is a real error and is raised. Kept apart from the
logger so `relog` and the CLI can classify errors without the logger's Lightning imports.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

__all__ = [
    "LOCK_RETRY_DELAYS",
    "OFFLINE_CLIENT",
    "TrackingUnavailableError",
    "is_locked_error",
    "is_unreachable_error",
    "short_reason",
]

_REASON_LIMIT = 300


class TrackingUnavailableError(RuntimeError):
    """The tracking store cannot be reached and the logger was told not to carry on offline."""


def _exception_chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    stack = [exc]
    while stack and len(seen) < 16:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        stack += [current.__cause__, current.__context__]


def _transport_errors() -> tuple[type[BaseException], ...]:
    kinds: list[type[BaseException]] = [ConnectionError, TimeoutError, socket.gaierror]
    try:
        import requests

        kinds.append(requests.exceptions.RequestException)
    except ImportError:  # pragma: no cover - mlflow depends on requests
        pass
    try:
        import urllib3

        kinds.append(urllib3.exceptions.HTTPError)
    except ImportError:  # pragma: no cover
        pass
    return tuple(kinds)


def is_unreachable_error(exc: BaseException) -> bool:
    """True when `exc` says the tracking store could not be reached or did not answer.

    Covers MLflow's wrapping of transport failures (`API request to ... failed with ...`,
    connection refused, timeouts, retries exhausted on 5xx answers), the exceptions themselves,
    and a SQLite/SQL store that is locked or unavailable (`OperationalError`). An error the
    server answered with (a bad parameter, an unknown run) is not one: that is a real error.
    """
    transport = _transport_errors()
    from mlflow.exceptions import MlflowException

    for error in _exception_chain(exc):
        if isinstance(error, transport):
            return True
        kind = type(error)
        if kind.__name__ == "OperationalError" and kind.__module__.startswith("sqlalchemy"):
            return True
        if isinstance(error, MlflowException):
            code = getattr(error, "error_code", "")
            if code in {"TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED"}:
                return True
            if str(getattr(error, "message", error)).startswith("API request to "):
                return True
    return False


#: Waits between attempts when a SQLite store answers "database is locked" (after MLflow's own
#: 20 s busy timeout each time): a store busy with another process's writes is not gone.
LOCK_RETRY_DELAYS = (0.25, 0.5, 1.0, 2.0, 4.0)


def is_locked_error(exc: BaseException) -> bool:
    """True when `exc` is SQLite saying another connection holds the database's lock."""
    for error in _exception_chain(exc):
        if type(error).__name__ == "OperationalError" and "is locked" in str(error):
            return True
    return False


def short_reason(exc: BaseException) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= _REASON_LIMIT else text[: _REASON_LIMIT - 3] + "..."


class _OfflineClient:
    """Stands in for the MlflowClient once the logger is offline: every method is a no-op
    returning None, so code that calls `logger.experiment.<method>(...)` does not crash."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: None

    def __repr__(self) -> str:
        return "<offline MLflow client: calls are skipped, see the run's mlflow_mirror.jsonl>"


OFFLINE_CLIENT = _OfflineClient()
