"""MLflow tracking: the training logger with its crash-proof mirror, and the replay of a mirror.

* `logger`: `SpecMLFlowLogger` (a SQLite store beside the run folders by default, every call
  mirrored to `<run_dir>/mlflow_mirror.jsonl` first, offline instead of failing when the store
  goes away) and the tracking-URI defaults.
* `mirror`: the run mirror (`RunMirror`) and its reader.
* `failures`: which errors mean the store is unreachable or locked (the logger then goes offline).
* `relog`: replays what a mirror holds and the store missed (`lightning-spec relog`).

docs/tracking.md describes both. Configs name the logger `lightning_spec.tracking.SpecMLFlowLogger`.
"""

from lightning_spec.tracking.failures import TrackingUnavailableError, is_unreachable_error
from lightning_spec.tracking.logger import (
    SpecMLFlowLogger,
    default_artifact_location,
    default_tracking_uri,
    make_mlflow_logger,
    safe_log_artifact,
)
from lightning_spec.tracking.mirror import MIRROR_NAME, RunMirror, read_mirror

__all__ = [
    "MIRROR_NAME",
    "RunMirror",
    "SpecMLFlowLogger",
    "TrackingUnavailableError",
    "default_artifact_location",
    "default_tracking_uri",
    "is_unreachable_error",
    "make_mlflow_logger",
    "read_mirror",
    "safe_log_artifact",
]
