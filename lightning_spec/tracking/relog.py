"""Replay a run's MLflow mirror into an MLflow tracking store (`lightning-spec relog`).

`SpecMLFlowLogger` appends everything it logs to `<run_dir>/mlflow_mirror.jsonl` before calling
MLflow, and stops calling MLflow when the store becomes unreachable (docs/tracking.md). `relog`
sends what did not get through: metrics with their original steps and timestamps (in
batches), parameters, artifacts whose files still exist, and the final run status.

Each logger session in the mirror (a `start` record: one `fit`, or one resumed job) is replayed
on its own. Target run, per session: `--run-id`, else a run this command already re-logged the
session into (recorded in the mirror), else the original run when it exists on the target
store, else a new run tagged with the run folder. Into the original run only what was not sent
(from the first failed call on) is replayed; into any other run, the whole session. Records a
previous `relog` already sent to the same run are skipped, so running it twice is harmless;
`--all` replays everything again (a SQL-backed store drops exact duplicate metric values).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

METRICS_PER_BATCH = 1000  # MLflow's log_batch limits
PARAMS_PER_BATCH = 100
DATA_TYPES = {"params", "metrics", "artifact"}


@dataclass
class Session:
    """The records of one logger session (from one `start` record to the next)."""

    start: dict[str, Any]
    records: list[dict[str, Any]] = field(default_factory=list)

    @property
    def key(self) -> int:
        return int(self.start["seq"])

    def last(self, kind: str) -> dict[str, Any] | None:
        return next((r for r in reversed(self.records) if r["type"] == kind), None)

    @property
    def original_run_id(self) -> str | None:
        run = self.last("run")
        return (run or {}).get("run_id") or self.start.get("requested_run_id")

    @property
    def first_unsent_seq(self) -> int | None:
        """Seq of the first record MLflow may not have got (None: the logger never went
        offline, everything reached the store)."""
        offline = next((r for r in self.records if r["type"] == "offline"), None)
        if offline is None:
            return None
        first = offline.get("first_unsent_seq")
        return int(offline["seq"] if first is None else first)

    @property
    def last_seq(self) -> int:
        return max([self.key] + [int(r["seq"]) for r in self.records])


@dataclass
class Report:
    session: int
    tracking_uri: str
    run_id: str | None = None
    created: bool = False
    metrics: int = 0
    params: int = 0
    artifacts: int = 0
    missing: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def line(self, dry_run: bool) -> str:
        verb = "would re-log" if dry_run else "re-logged"
        run = self.run_id or "(new run)"
        where = f"{'new ' if self.created else ''}run {run} at {self.tracking_uri}"
        text = (
            f"session {self.session}: {verb} {self.metrics} metric values, {self.params} "
            f"params, {self.artifacts} artifacts into {where}"
        )
        if self.missing:
            text += f"; {len(self.missing)} artifact paths no longer exist: {self.missing}"
        return "; ".join([text, *self.notes])


def split_sessions(records: list[dict[str, Any]]) -> tuple[list[Session], list[dict[str, Any]]]:
    """Sessions in file order, and the `relog` records (written by this command)."""
    sessions: list[Session] = []
    relogs = []
    for record in records:
        if record["type"] == "relog":
            relogs.append(record)
        elif record["type"] == "start":
            sessions.append(Session(start=record))
        elif sessions:
            sessions[-1].records.append(record)
        else:  # records before any start record: keep them in a session of their own
            sessions.append(Session(start={"seq": record["seq"], "type": "start"}))
            sessions[-1].records.append(record)
    return sessions, relogs


def _run_exists(client: Any, run_id: str | None) -> bool:
    if not run_id:
        return False
    from mlflow.exceptions import MlflowException

    from lightning_spec.tracking.failures import is_unreachable_error

    try:
        run = client.get_run(run_id)
    except MlflowException as exc:
        if is_unreachable_error(exc):
            raise
        return False
    return run.info.lifecycle_stage != "deleted"


def _experiment_id(client: Any, name: str, run_dir: Path, uri: str) -> str:
    from lightning_spec.tracking.logger import default_artifact_location

    experiment = client.get_experiment_by_name(name)
    if experiment is not None and experiment.lifecycle_stage != "deleted":
        return experiment.experiment_id
    return client.create_experiment(
        name, artifact_location=default_artifact_location(run_dir, name, uri)
    )


def _new_run(client: Any, session: Session, run_dir: Path, uri: str, experiment: str | None) -> str:
    start = session.start
    name = experiment or start.get("experiment_name") or "lightning-spec"
    tags = {str(k): str(v) for k, v in (start.get("tags") or {}).items()}
    tags["lightning_spec.run_dir"] = str(run_dir)
    tags["lightning_spec.relogged_from"] = str(run_dir / "mlflow_mirror.jsonl")
    if session.original_run_id:
        tags["lightning_spec.original_run_id"] = session.original_run_id
    run = client.create_run(
        _experiment_id(client, name, run_dir, uri),
        start_time=int(float(start.get("time", 0)) * 1000) or None,
        tags=tags,
        run_name=start.get("run_name") or run_dir.name,
    )
    return run.info.run_id


def relog_session(
    client: Any,
    session: Session,
    relogs: list[dict[str, Any]],
    *,
    uri: str,
    run_dir: Path,
    run_id: str | None = None,
    new_run: bool = False,
    experiment: str | None = None,
    replay_all: bool = False,
    dry_run: bool = False,
) -> tuple[Report, dict[str, Any] | None]:
    """Replay one session; returns the report and the `relog` record to append (or None)."""
    from mlflow.entities import Metric, Param

    report = Report(session=session.key, tracking_uri=uri)
    mine = [r for r in relogs if r.get("session") == session.key and r.get("tracking_uri") == uri]
    original = session.original_run_id
    if run_id:
        if not _run_exists(client, run_id):
            raise SystemExit(f"lightning-spec relog: run {run_id} does not exist at {uri}")
        target = run_id
    elif new_run:
        target = None
    else:
        target = next(
            (r["run_id"] for r in reversed(mine) if _run_exists(client, r.get("run_id"))), None
        )
        if target is None and _run_exists(client, original):
            target = original
    report.run_id = target
    report.created = target is None

    # Which records: into the original run only what it did not get; skip what a previous
    # relog already sent to the same run.
    if replay_all:
        first = 0
    elif target is not None and target == original:
        first = session.first_unsent_seq
        if first is None:
            report.notes.append("nothing to send: the logger never lost the store")
            first = session.last_seq + 1
    else:
        first = 0
    done = max(
        (int(r["through_seq"]) for r in mine if r.get("run_id") == target and target), default=-1
    )
    if not replay_all:
        first = max(first, done + 1)
    chosen = [r for r in session.records if r["type"] in DATA_TYPES and int(r["seq"]) >= first]
    end = session.last("end")
    if end is None:
        report.notes.append(
            "no end record: the training process did not finish (killed, or still running)"
        )

    metrics = [
        Metric(key=k, value=float(v), timestamp=int(r["timestamp"]), step=int(r["step"]))
        for r in chosen
        if r["type"] == "metrics"
        for k, v in r["metrics"].items()
    ]
    params: dict[str, str] = {}
    for record in chosen:
        if record["type"] == "params":
            params.update({str(k): str(v) for k, v in record["params"].items()})
    artifacts: dict[tuple[str, str | None], bool] = {}
    for record in chosen:
        if record["type"] == "artifact":
            artifacts[(record["local_path"], record.get("artifact_path"))] = bool(record.get("dir"))
    existing = {key: d for key, d in artifacts.items() if Path(key[0]).exists()}
    report.missing = sorted({p for p, _ in artifacts if not Path(p).exists()})
    report.metrics, report.artifacts = len(metrics), len(existing)

    status = None
    if target is not None:
        run = client.get_run(target)
        have, status = run.data.params, run.info.status
        clash = sorted(k for k, v in params.items() if k in have and have[k] != v)
        if clash:
            report.notes.append(f"params kept as the run has them (differ in the mirror): {clash}")
        params = {k: v for k, v in params.items() if k not in have}
    report.params = len(params)
    nothing = not (metrics or params or existing)
    settled = end is None or end["status"] == status
    if nothing and not any(note.startswith("nothing") for note in report.notes):
        report.notes.append("nothing new to send")
    if dry_run or (nothing and target is not None and settled):
        return report, None

    if target is None:
        target = _new_run(client, session, run_dir, uri, experiment)
        report.run_id = target
    items = [Param(key=k, value=v) for k, v in params.items()]
    for i in range(0, len(items), PARAMS_PER_BATCH):
        client.log_batch(target, params=items[i : i + PARAMS_PER_BATCH])
    for i in range(0, len(metrics), METRICS_PER_BATCH):
        client.log_batch(target, metrics=metrics[i : i + METRICS_PER_BATCH])
    for (path, artifact_path), is_dir in existing.items():
        upload = client.log_artifacts if is_dir else client.log_artifact
        upload(target, path, artifact_path)
    if end is not None:
        client.set_terminated(target, end["status"], end_time=int(float(end["time"]) * 1000))
    marker = {
        "session": session.key,
        "tracking_uri": uri,
        "run_id": target,
        "through_seq": session.last_seq,
        "metrics": report.metrics,
        "params": report.params,
        "artifacts": report.artifacts,
    }
    return report, marker


def relog(
    run_dir: str | Path,
    *,
    tracking_uri: str | None = None,
    run_id: str | None = None,
    new_run: bool = False,
    experiment: str | None = None,
    replay_all: bool = False,
    dry_run: bool = False,
) -> list[Report]:
    """Replay the mirror of `run_dir` (see the module docstring); returns one report per
    session. Appends a `relog` record per session it sent, unless `dry_run`."""
    from mlflow.tracking import MlflowClient

    from lightning_spec.tracking.mirror import MIRROR_NAME, RunMirror, read_mirror

    path = Path(run_dir).expanduser().resolve()
    if path.is_file():
        mirror_path, folder = path, path.parent
    else:
        mirror_path, folder = path / MIRROR_NAME, path
    if not mirror_path.is_file():
        raise FileNotFoundError(f"no MLflow mirror at {mirror_path}")
    records, bad = read_mirror(mirror_path)
    sessions, relogs = split_sessions(records)
    mirror = RunMirror(mirror_path)
    reports = []
    clients: dict[str, Any] = {}
    for session in sessions:
        uri = tracking_uri or session.start.get("tracking_uri")
        if not uri:
            raise SystemExit(
                f"lightning-spec relog: session {session.key} recorded no tracking URI; "
                "pass --tracking-uri"
            )
        client = clients.setdefault(uri, MlflowClient(uri))
        report, marker = relog_session(
            client,
            session,
            relogs,
            uri=uri,
            run_dir=folder,
            run_id=run_id,
            new_run=new_run,
            experiment=experiment,
            replay_all=replay_all,
            dry_run=dry_run,
        )
        if bad:
            report.notes.append(f"{bad} unreadable mirror lines skipped")
        if marker is not None:
            mirror.write("relog", **marker)
        reports.append(report)
    return reports
