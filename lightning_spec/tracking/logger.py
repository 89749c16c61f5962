"""MLflow tracking defaults: a SQLite store beside the run folders, artifacts in a known place.

MLflow 3 refuses its old file store, and an experiment created without `artifact_location`
puts artifacts relative to the current directory. So by default every run folder
`<root>/<run>` shares `<root>/mlflow.db` (SQLite, absolute path) and `<root>/mlartifacts/`;
`MLFLOW_TRACKING_URI`, when set, wins (a server then decides where artifacts go). `mlflow`
itself is imported only when a logger first talks to the store (~5 s import).

A tracking server that goes away must not cost a training run (docs/tracking.md). The logger
therefore first appends everything it logs (params, metrics with step and timestamp, artifact
paths, the final status) to `<run_dir>/mlflow_mirror.jsonl` (`tracking/mirror.py`), and only
then calls MLflow. When a call fails because the store cannot be reached
(`tracking/failures.py`), it warns once, goes offline (no further calls, so no per-step
retries) and training carries on; `lightning-spec relog <run_dir>` later replays the mirror
into MLflow.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_only

from lightning_spec.tracking.failures import (
    LOCK_RETRY_DELAYS,
    OFFLINE_CLIENT,
    TrackingUnavailableError,
    is_locked_error,
    is_unreachable_error,
    short_reason,
)
from lightning_spec.tracking.mirror import MIRROR_NAME, RunMirror, read_mirror

__all__ = [
    "SpecMLFlowLogger",
    "default_artifact_location",
    "default_tracking_uri",
    "make_mlflow_logger",
    "safe_log_artifact",
]

log = logging.getLogger("lightning_spec.tracking")
"""The package's name, not this module's: users filter and configure `lightning_spec.tracking`."""

TRACKING_ENV = "MLFLOW_TRACKING_URI"
# MLflow retries an unreachable server 7 times with backoff factor 2 and waits 120 s per
# request by default: minutes per call. For remote stores the logger sets these bounded
# defaults (an outage then costs ~3 s, or ~3x the timeout for a host that drops packets),
# only for variables the user has not set.
HTTP_RETRIES_ENV = "MLFLOW_HTTP_REQUEST_MAX_RETRIES"
HTTP_BACKOFF_ENV = "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"
HTTP_TIMEOUT_ENV = "MLFLOW_HTTP_REQUEST_TIMEOUT"
_PARAM_LIMIT = 250  # what Lightning's MLFlowLogger keeps of a parameter value


def _run_root(run_dir: str | Path) -> Path:
    return Path(run_dir).expanduser().resolve().parent


def default_tracking_uri(run_dir: str | Path) -> str:
    """`$MLFLOW_TRACKING_URI`, else `sqlite:////<abs parent of run_dir>/mlflow.db`."""
    env = os.environ.get(TRACKING_ENV)
    if env:
        return env
    root = _run_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)  # SQLite creates the file, not its folder
    return f"sqlite:///{root / 'mlflow.db'}"


def _is_local(tracking_uri: str) -> bool:
    return tracking_uri.startswith(("sqlite:", "file:")) or "://" not in tracking_uri


def _is_http(tracking_uri: str) -> bool:
    return tracking_uri.startswith(("http://", "https://"))


def default_artifact_location(
    run_dir: str | Path, experiment_name: str, tracking_uri: str
) -> str | None:
    """`file://<abs parent of run_dir>/mlartifacts/<experiment>` for local stores; None (the
    server's choice) for remote ones."""
    if not _is_local(tracking_uri):
        return None
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", experiment_name).strip("_") or "default"
    return (_run_root(run_dir) / "mlartifacts" / safe).as_uri()


# --------------------------------------------------------------------------- the logger


class SpecMLFlowLogger(MLFlowLogger):
    """Lightning's MLFlowLogger with this project's defaults (see the module docstring).

    Usable from a LightningCLI config: `class_path: lightning_spec.tracking.SpecMLFlowLogger`.
    Everything it logs is mirrored to `<run_dir>/mlflow_mirror.jsonl` first; when the store
    becomes unreachable it warns once and goes offline (`offline` is True) instead of failing
    the run. `experiment` then returns a stand-in whose methods do nothing; use
    `safe_log_artifact` rather than `experiment.log_artifact` so artifacts are mirrored too.
    """

    def __init__(
        self,
        experiment_name: str = "lightning-spec",
        run_dir: str = "runs/default",
        run_name: str | None = None,
        tracking_uri: str | None = None,
        tags: dict[str, Any] | None = None,
        log_model: bool = False,
        run_id: str | None = None,
        offline_on_error: bool = True,
        offline_at_start: bool = True,
        http_retries: int | None = 2,
        http_timeout: int | None = 10,
    ) -> None:
        """
        Args:
            experiment_name: MLflow experiment (created on first use).
            run_dir: This run's folder; the store and artifacts sit in its parent.
            run_name: MLflow run name (default: the run folder's name).
            tracking_uri: Explicit store URI; default `$MLFLOW_TRACKING_URI` or the SQLite file.
            tags: Extra run tags.
            log_model: Log Lightning checkpoints as artifacts (Lightning's option).
            run_id: Continue this existing run (resuming a job) instead of starting one.
            offline_on_error: When the store becomes unreachable, warn once and keep training
                offline (everything stays in the mirror). False: raise
                `TrackingUnavailableError` instead.
            offline_at_start: Also train offline when the store is unreachable before the run
                exists. False: fail at the start with `TrackingUnavailableError` (a typo in
                the URI then stops the job before it spends compute).
            http_retries: For http(s) URIs, `MLFLOW_HTTP_REQUEST_MAX_RETRIES` (and backoff
                factor 1) unless set in the environment; None keeps MLflow's default (7, with
                backoff 2: minutes per call against a dead server).
            http_timeout: For http(s) URIs, `MLFLOW_HTTP_REQUEST_TIMEOUT` in seconds unless set
                in the environment; None keeps MLflow's 120 s.
        """
        uri = tracking_uri or default_tracking_uri(run_dir)
        if _is_http(uri):
            # Process-wide: other MLflow clients in this process get the same bounds.
            if http_retries is not None:
                os.environ.setdefault(HTTP_RETRIES_ENV, str(int(http_retries)))
                os.environ.setdefault(HTTP_BACKOFF_ENV, "1")
            if http_timeout is not None:
                os.environ.setdefault(HTTP_TIMEOUT_ENV, str(int(http_timeout)))
        super().__init__(
            experiment_name=experiment_name,
            run_name=run_name or Path(run_dir).name,
            tracking_uri=uri,
            tags=tags,
            log_model=log_model,
            artifact_location=default_artifact_location(run_dir, experiment_name, uri),
            run_id=run_id,
        )
        self.run_dir = str(Path(run_dir).expanduser().resolve())
        self.offline_on_error = offline_on_error
        self.offline_at_start = offline_at_start
        self.mirror = RunMirror(Path(self.run_dir) / MIRROR_NAME)
        self._session_started = False
        self._offline = False
        self._offline_reason: str | None = None
        self._offline_version: str | None = None
        self._sending: int | None = None  # seq of the record the current MLflow call carries
        self._run_recorded = False

    # -- state --------------------------------------------------------------------------

    @property
    def offline(self) -> bool:
        """True once the store was found unreachable: nothing more is sent this run."""
        return self._offline

    @property
    def mirror_path(self) -> Path:
        return self.mirror.path

    @property
    def relog_command(self) -> str:
        return f"lightning-spec relog {self.run_dir}"

    def _where(self) -> str:
        kind = "server" if not _is_local(self._tracking_uri) else "store"
        return f"tracking {kind} {self._tracking_uri}"

    def _record(self, kind: str, **fields: Any) -> int | None:
        if rank_zero_only.rank > 0:  # one mirror per run, written by the process that logs
            return None
        if not self._session_started:
            self._session_started = True
            self.mirror.write(
                "start",
                tracking_uri=self._tracking_uri,
                experiment_name=self._experiment_name,
                run_name=self._run_name,
                requested_run_id=self._run_id,
                tags=dict(self.tags or {}),
                run_dir=self.run_dir,
                host=socket.gethostname(),
                pid=os.getpid(),
            )
        return self.mirror.write(kind, **fields)

    def _go_offline(self, exc: BaseException, during: str) -> None:
        """Record the failure and warn once; raise when the configuration says to stop."""
        at_start = not self._initialized
        first_unsent = self._sending
        self._offline = True
        self._offline_reason = short_reason(exc)
        self._record(
            "offline", reason=self._offline_reason, during=during, first_unsent_seq=first_unsent
        )
        if self._run_id is None:
            self._offline_version = "offline-" + time.strftime("%Y%m%d-%H%M%S")
        if not self.offline_on_error or (at_start and not self.offline_at_start):
            raise TrackingUnavailableError(
                f"{self._where()} unreachable while {during}: {self._offline_reason}. "
                f"What was logged is kept in {self.mirror_path}; re-log it with "
                f"`{self.relog_command}`. (Pass offline_on_error=True / offline_at_start=True "
                "to keep training offline instead.)"
            ) from exc
        log.warning(
            "%s unreachable: %s; training continues, metrics are kept in %s; re-log them with `%s`",
            self._where(),
            self._offline_reason,
            self.mirror_path,
            self.relog_command,
        )

    def _guarded(self, seq: int | None, during: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Call `fn` unless offline; an unreachable store makes the logger go offline."""
        if self._offline:
            return None
        self._sending = seq
        try:
            for attempt, delay in enumerate((*LOCK_RETRY_DELAYS, None)):
                try:
                    return fn(*args, **kwargs)
                except TrackingUnavailableError:
                    raise
                except Exception as exc:
                    if self._offline:  # `experiment` already went offline inside fn
                        return None
                    if delay is not None and is_locked_error(exc):
                        # another process writes the SQLite store: wait, it is not gone
                        log.info("tracking store locked while %s: retry %d in %.2f s",
                                 during, attempt + 1, delay)  # fmt: skip
                        time.sleep(delay)
                        continue
                    if not is_unreachable_error(exc):
                        raise
                    self._go_offline(exc, during)
                    return None
            return None  # pragma: no cover - the last attempt returns or raises
        finally:
            self._sending = None

    # -- MLflow objects -----------------------------------------------------------------

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        """The MlflowClient (creating the run on first use); once offline, a stand-in whose
        methods do nothing."""
        if self._offline:
            return OFFLINE_CLIENT
        if self._initialized:
            return self._mlflow_client
        try:
            client = MLFlowLogger.experiment.fget(self)
        except Exception as exc:
            if not is_unreachable_error(exc):
                raise
            self._go_offline(exc, "creating the MLflow run")
            return OFFLINE_CLIENT
        if not self._run_recorded:
            self._run_recorded = True
            earlier = self._earlier_sessions()
            self._record("run", run_id=self._run_id, experiment_id=self._experiment_id)
            self._close_killed_runs(client, earlier)
        return client

    def _earlier_sessions(self) -> list[list[dict[str, Any]]]:
        """The mirror's records grouped by logging session (each opens with `start`), before
        this one's; empty for a fresh run folder."""
        if not self.mirror.path.is_file():
            return []
        records, _ = read_mirror(self.mirror.path)
        sessions: list[list[dict[str, Any]]] = []
        for record in records:
            if record.get("type") == "start" or not sessions:
                sessions.append([])
            sessions[-1].append(record)
        if self._session_started and sessions:
            sessions.pop()  # this session's own records
        return sessions

    def _close_killed_runs(self, client: Any, sessions: list[list[dict[str, Any]]]) -> None:
        """Mark KILLED the MLflow runs of earlier sessions in this folder that never ended and
        whose process is gone (a SIGKILL, an OOM kill, a lost node): they would stay RUNNING
        forever. Runs this session continues, and runs of live or remote processes, are left."""
        recovered = {r.get("run_id") for s in sessions for r in s if r.get("type") == "killed_run"}
        for session in sessions:
            start = session[0]
            runs = [r.get("run_id") for r in session if r.get("type") == "run" and r.get("run_id")]
            ended = any(r.get("type") == "end" for r in session)
            if not runs or ended or runs[-1] == self._run_id or runs[-1] in recovered:
                continue
            if start.get("host") != socket.gethostname() or _pid_alive(start.get("pid")):
                continue
            run_id = runs[-1]
            try:
                if client.get_run(run_id).info.status == "RUNNING":
                    client.set_terminated(run_id, status="KILLED")
                    log.warning(
                        "MLflow run %s of this folder was left RUNNING by a killed process "
                        "(pid %s): marked KILLED", run_id, start.get("pid"),
                    )  # fmt: skip
                self._record("killed_run", run_id=run_id, status="KILLED")
            except Exception as exc:  # never fail a new run over an old one's status
                log.warning("could not mark the killed run %s: %s", run_id, short_reason(exc))

    @property
    def name(self) -> str | None:
        """The experiment id (`offline` when the run could not be created)."""
        return self.experiment_id or ("offline" if self._offline else None)

    @property
    def version(self) -> str | None:
        """The run id (`offline-<time>` when the run could not be created)."""
        return self.run_id or self._offline_version

    @property
    def save_dir(self) -> str:
        """The run folder: `trainer.log_dir` reads it, and LightningCLI saves the resolved
        config there (MLflow's own save_dir is None for a database store, which stops the CLI)."""
        return self.run_dir

    # -- logging --------------------------------------------------------------------------

    @rank_zero_only
    def log_hyperparams(self, params: Any) -> None:
        from lightning.fabric.utilities.logger import _convert_params, _flatten_dict

        flat = _flatten_dict(_convert_params(params))
        values = {key: str(value)[:_PARAM_LIMIT] for key, value in flat.items()}
        seq = self._record("params", params=values)
        if self._offline:
            return

        def send() -> None:
            from mlflow.entities import Param

            items = [Param(key=k, value=v) for k, v in values.items()]
            for start in range(0, len(items), 100):
                self.experiment.log_batch(
                    run_id=self.run_id, params=items[start : start + 100], **self._log_batch_kwargs
                )

        self._guarded(seq, "logging hyperparameters", send)

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        from lightning.fabric.utilities.logger import _add_prefix
        from lightning.fabric.utilities.rank_zero import rank_zero_warn

        timestamp_ms = int(time.time() * 1000)
        clean: dict[str, float] = {}
        for key, value in _add_prefix(dict(metrics), self._prefix, self.LOGGER_JOIN_CHAR).items():
            if isinstance(value, str):
                log.warning("Discarding metric with string value %s=%s.", key, value)
                continue
            new_key = re.sub("[^a-zA-Z0-9_/. -]+", "", key)
            if key != new_key:
                rank_zero_warn(
                    "MLFlow only allows '_', '/', '.' and ' ' special characters in metric name."
                    f" Replacing {key} with {new_key}.",
                    category=RuntimeWarning,
                )
            clean[new_key] = float(value.item() if hasattr(value, "item") else value)
        step = step or 0
        seq = self._record("metrics", step=step, timestamp=timestamp_ms, metrics=clean)
        if self._offline or not clean:
            return

        def send() -> None:
            from mlflow.entities import Metric

            batch = [
                Metric(key=k, value=v, timestamp=timestamp_ms, step=step) for k, v in clean.items()
            ]
            self.experiment.log_batch(run_id=self.run_id, metrics=batch, **self._log_batch_kwargs)

        self._guarded(seq, "logging metrics", send)

    def safe_log_artifact(self, local_path: str | Path, artifact_path: str | None = None) -> bool:
        """Log a file or a folder as run artifacts without ever failing training.

        The path is mirrored first (so `lightning-spec relog` uploads it later if it still
        exists). Returns True when MLflow took it; False when offline or when the upload
        failed (a warning says why; the files stay where they are).
        """
        if rank_zero_only.rank > 0:
            return False
        path = Path(local_path).expanduser().resolve()
        is_dir = path.is_dir()
        seq = self._record(
            "artifact", local_path=str(path), artifact_path=artifact_path, dir=is_dir
        )
        if self._offline:
            return False

        def send() -> bool:
            client = self.experiment
            if self._offline:
                return False
            upload = client.log_artifacts if is_dir else client.log_artifact
            upload(self.run_id, str(path), artifact_path)
            return True

        try:
            return bool(self._guarded(seq, f"logging artifact {path.name}", send))
        except TrackingUnavailableError:
            raise
        except Exception as exc:  # an artifact never stops training
            log.warning(
                "could not log artifact %s to MLflow (%s); it stays on disk", path, short_reason(exc)
            )
            return False

    def _scan_and_log_checkpoints(self, checkpoint_callback: Any) -> None:
        """Lightning's checkpoint logging (`log_model`), mirrored and guarded."""
        from lightning.pytorch.loggers.utilities import _scan_checkpoints

        pending = _scan_checkpoints(checkpoint_callback, dict(self._logged_model_time))
        seq = None
        for _, path, _, _ in pending:
            number = self._record(
                "artifact",
                local_path=str(Path(path).resolve()),
                artifact_path=Path(path).stem,
                dir=False,
            )
            seq = number if seq is None else seq
        if self._offline:
            for mtime, path, _, _ in pending:
                self._logged_model_time[path] = mtime
            return
        self._guarded(
            seq, "logging checkpoints", super()._scan_and_log_checkpoints, checkpoint_callback
        )

    @rank_zero_only
    def finalize(self, status: str = "success") -> None:
        final = {"success": "FINISHED", "finished": "FINISHED", "failed": "FAILED"}.get(
            status, status
        )
        seq = self._record("end", status=final) if self._session_started else None
        if self.mirror.pending or self.mirror.dropped:
            log.error(
                "the disk stayed full: %d tracking record(s) never reached %s (%d dropped beyond "
                "the in-memory limit); MLflow received them while it was reachable",
                self.mirror.pending + self.mirror.dropped,
                self.mirror_path,
                self.mirror.dropped,
            )
        if self._offline:
            log.info(
                "MLflow run %s was not closed (the %s went away); its metrics are in %s; "
                "`%s` re-logs them and sets the status %s",
                self._run_id or "(never created)",
                self._where(),
                self.mirror_path,
                self.relog_command,
                final,
            )
            return
        if not self._initialized:
            return
        self._guarded(seq, "finishing the run", super().finalize, status)


def _pid_alive(pid: Any) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError, ValueError, TypeError):
        return True
    return True


def safe_log_artifact(
    logger: Any, local_path: str | Path, artifact_path: str | None = None
) -> bool:
    """Log a file or folder through any MLflow logger without ever failing training.

    `SpecMLFlowLogger` mirrors and guards it (`SpecMLFlowLogger.safe_log_artifact`); for a plain
    Lightning `MLFlowLogger` the call is tried and a failure only warns.
    """
    if isinstance(logger, SpecMLFlowLogger):
        return logger.safe_log_artifact(local_path, artifact_path)
    path = Path(local_path)
    try:
        client = logger.experiment
        upload = client.log_artifacts if path.is_dir() else client.log_artifact
        upload(logger.run_id, str(path), artifact_path)
        return True
    except Exception as exc:  # an artifact never stops training
        log.warning("could not log artifact %s to MLflow (%s); it stays on disk", path, short_reason(exc))
        return False


def make_mlflow_logger(
    experiment_name: str,
    run_dir: str | Path,
    run_name: str | None = None,
    *,
    tracking_uri: str | None = None,
    tags: dict[str, Any] | None = None,
    **kwargs: Any,
) -> SpecMLFlowLogger:
    """An MLflow logger whose store and artifact location never depend on the cwd (extra
    keyword arguments go to `SpecMLFlowLogger`)."""
    return SpecMLFlowLogger(
        experiment_name=experiment_name,
        run_dir=str(run_dir),
        run_name=run_name,
        tracking_uri=tracking_uri,
        tags=tags,
        **kwargs,
    )
