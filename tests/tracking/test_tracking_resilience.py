"""A tracking server that goes away costs no training: mirror, offline mode, `relog` (issue #5).

The server tests run a real `mlflow server` on a free loopback port and kill its process group
mid-run; one server start is shared where the tests run in file order (starting one costs ~12 s).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from lightning_spec.tracking import (
    MIRROR_NAME,
    SpecMLFlowLogger,
    TrackingUnavailableError,
    read_mirror,
)

HTTP_ENV = (
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR",
    "MLFLOW_HTTP_REQUEST_TIMEOUT",
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The logger sets bounded HTTP defaults process-wide; restore the environment after."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for name in HTTP_ENV:
        monkeypatch.delenv(name, raising=False)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _offline_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "lightning_spec.tracking" and "unreachable" in r.getMessage()
    ]


def _relog(*argv: str) -> int:
    from lightning_spec.cli import main

    return main(["relog", *argv])


class MlflowServer:
    """One `mlflow server` process group on a fixed database and port; restartable."""

    def __init__(self, root: Path) -> None:
        self.db = root / "server.db"
        self.artifacts = root / "server-artifacts"
        self.port = _free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.log = root / "server.log"
        self.process: subprocess.Popen | None = None

    @property
    def up(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def ensure_up(self, timeout: float = 90.0) -> None:
        if self.up:
            return
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        env.pop("MLFLOW_TRACKING_URI", None)
        command = [
            sys.executable, "-m", "mlflow", "server",
            "--backend-store-uri", f"sqlite:///{self.db}",
            "--artifacts-destination", str(self.artifacts),
            "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
        ]  # fmt: skip
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        tail = self.log.read_text(errors="replace")[-2000:]
        self.kill()
        pytest.skip(f"mlflow server did not start:\n{tail}")

    def kill(self) -> None:
        """SIGKILL the whole process group (the server and its uvicorn worker)."""
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=30)
        self.process = None


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One SQLite store for the tests without a server (creating one costs ~3 s)."""
    return f"sqlite:///{tmp_path_factory.mktemp('store') / 'mlflow.db'}"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    manager = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    try:
        yield manager
    finally:
        manager.kill()


# --------------------------------------------------------------------------- no server


def test_mirror_holds_everything_logged(tmp_path: Path, store: str) -> None:
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "runs" / "r1"
    logger = SpecMLFlowLogger(
        experiment_name="mirror", run_dir=str(run_dir), tracking_uri=store, tags={"k": "v"}
    )
    logger.log_hyperparams({"lr": 0.1, "model": {"depth": 2}})
    for step in range(3):
        logger.log_metrics({"train/loss": 1.0 / (step + 1), "bad:name": 2.0}, step=step)
    plot = tmp_path / "plot.png"
    plot.write_bytes(b"png")
    assert logger.safe_log_artifact(plot, "plots")
    logger.finalize("success")
    assert not logger.offline

    records, bad = read_mirror(run_dir)
    assert bad == 0 and (run_dir / MIRROR_NAME).is_file()
    assert [r["seq"] for r in records] == list(range(len(records)))
    assert [r["type"] for r in records] == [
        "start", "params", "run", "metrics", "metrics", "metrics", "artifact", "end",
    ]  # fmt: skip
    start = records[0]
    assert start["tracking_uri"] == logger._tracking_uri and start["experiment_name"] == "mirror"
    assert start["tags"] == {"k": "v"} and start["run_dir"] == str(run_dir)
    assert records[1]["params"] == {"lr": "0.1", "model/depth": "2"}
    assert records[2]["run_id"] == logger.run_id
    metrics = [r for r in records if r["type"] == "metrics"]
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert metrics[1]["metrics"] == {"train/loss": 0.5, "badname": 2.0}  # as MLflow got them
    assert records[6]["local_path"] == str(plot) and records[6]["artifact_path"] == "plots"
    assert records[-1]["status"] == "FINISHED"

    # The mirror's timestamps are the ones MLflow stored: a relog reproduces the history.
    client = MlflowClient(logger._tracking_uri)
    history = client.get_metric_history(logger.run_id, "train/loss")
    assert [(m.step, m.timestamp) for m in history] == [
        (m["step"], m["timestamp"]) for m in metrics
    ]
    assert client.get_run(logger.run_id).info.status == "FINISHED"

    # An error the store answers with is a real error, not an outage: it still raises.
    with pytest.raises(MlflowException):
        logger.log_hyperparams({"lr": 0.2})  # MLflow refuses to change a parameter
    assert not logger.offline


def test_http_defaults_are_bounded_but_never_override_the_user(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "33")
    SpecMLFlowLogger(run_dir=str(tmp_path / "r"), tracking_uri="http://127.0.0.1:9")  # no call
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "2"
    assert os.environ["MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"] == "1"
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "33"


def test_local_store_leaves_http_settings_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning.pytorch.loggers import MLFlowLogger

    monkeypatch.setattr(MLFlowLogger, "__init__", lambda self, **kwargs: None)  # no store
    SpecMLFlowLogger(run_dir=str(tmp_path / "runs" / "r"))
    assert not any(name in os.environ for name in HTTP_ENV)


def test_unreachable_at_start_trains_offline_then_relogs_into_a_new_run(
    tmp_path: Path, store: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # the user's value is kept
    dead = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    run_dir = tmp_path / "runs" / "offline"
    caplog.set_level(logging.WARNING, logger="lightning_spec.tracking")
    logger = SpecMLFlowLogger(experiment_name="late", run_dir=str(run_dir), tracking_uri=dead)
    began = time.monotonic()
    logger.log_hyperparams({"lr": 0.5})
    assert logger.offline and logger.run_id is None
    assert logger.name == "offline" and logger.version.startswith("offline-")
    for step in range(5):
        logger.log_metrics({"loss": float(step)}, step=step)
    assert logger.safe_log_artifact(__file__, "code") is False
    logger.finalize("success")
    assert time.monotonic() - began < 10
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "0"
    (warning,) = _offline_warnings(caplog)
    assert dead in warning and str(run_dir / MIRROR_NAME) in warning
    assert f"lightning-spec relog {run_dir}" in warning

    # The server never existed: replay into another store; a new run points at the folder.
    assert _relog(str(run_dir), "--tracking-uri", store) == 0
    assert _relog(str(run_dir), "--tracking-uri", store) == 0  # twice: no duplicates
    client = MlflowClient(store)
    (run,) = client.search_runs([client.get_experiment_by_name("late").experiment_id])
    assert run.data.tags["lightning_spec.run_dir"] == str(run_dir)
    assert run.data.params == {"lr": "0.5"} and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(s, float(s)) for s in range(5)]
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["code"]
    relogs = [r for r in read_mirror(run_dir)[0] if r["type"] == "relog"]
    assert len(relogs) == 1 and relogs[0]["run_id"] == run.info.run_id


def test_fail_at_start_when_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    dead = f"http://127.0.0.1:{_free_port()}"
    logger = SpecMLFlowLogger(
        run_dir=str(tmp_path / "r"), tracking_uri=dead, offline_at_start=False
    )
    with pytest.raises(TrackingUnavailableError, match="unreachable") as caught:
        logger.log_hyperparams({"lr": 0.5})
    assert dead in str(caught.value) and MIRROR_NAME in str(caught.value)
    assert logger.offline  # Lightning's finalize("failed") then does not wait on the server
    logger.finalize("failed")


def test_relog_cli_reports_a_missing_mirror(tmp_path: Path, capsys) -> None:
    assert _relog(str(tmp_path)) == 2
    assert "no MLflow mirror" in capsys.readouterr().err


# --------------------------------------------------------------------------- real server


def test_server_killed_mid_run_then_relog(
    server: MlflowServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from mlflow.tracking import MlflowClient

    server.ensure_up()
    run_dir = tmp_path / "runs" / "killed"
    caplog.set_level(logging.WARNING, logger="lightning_spec.tracking")
    logger = SpecMLFlowLogger(experiment_name="ops", run_dir=str(run_dir), tracking_uri=server.uri)
    logger.log_hyperparams({"lr": 0.1})
    for step in range(5):
        logger.log_metrics({"loss": 10.0 - step}, step=step)
    assert not logger.offline and logger.run_id
    run_id = logger.run_id

    server.kill()
    plot = tmp_path / "plot.png"
    plot.write_bytes(b"png")
    began = time.monotonic()
    logger.log_metrics({"loss": 5.0}, step=5)  # the one call that meets the dead server
    first = time.monotonic() - began
    for step in range(6, 10):  # a training loop carries on, at mirror speed
        logger.log_metrics({"loss": 10.0 - step}, step=step)
    assert logger.safe_log_artifact(plot, "plots") is False
    logger.finalize("success")
    rest = time.monotonic() - began - first
    assert logger.offline
    assert first < 15, f"bounded retries: {first:.1f} s"
    assert rest < 1, f"no calls once offline: {rest:.2f} s"
    (warning,) = _offline_warnings(caplog)
    assert server.uri in warning and str(run_dir / MIRROR_NAME) in warning
    assert f"`lightning-spec relog {run_dir}`" in warning
    steps = [r["step"] for r in read_mirror(run_dir)[0] if r["type"] == "metrics"]
    assert steps == list(range(10))

    server.ensure_up()  # same database, same port: the URI the mirror recorded
    assert _relog(str(run_dir)) == 0
    client = MlflowClient(server.uri)
    history = client.get_metric_history(run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [(s, 10.0 - s) for s in range(10)]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params == {"lr": "0.1"}
    assert [a.path for a in client.list_artifacts(run_id, "plots")] == ["plots/plot.png"]
    assert _relog(str(run_dir)) == 0  # again: nothing new is sent
    assert len(client.get_metric_history(run_id, "loss")) == 10


def test_fit_survives_the_server_dying_mid_fit(
    server: MlflowServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import torch
    from lightning.pytorch import Callback, LightningModule, Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from mlflow.tracking import MlflowClient
    from torch.utils.data import DataLoader, TensorDataset

    class Tiny(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            loss = self.layer(batch[0]).pow(2).mean()
            self.log("train/loss", loss, on_step=True, on_epoch=False)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class KillServer(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if batch_idx == 0:
                server.kill()

    server.ensure_up()
    run_dir = tmp_path / "runs" / "fit"
    caplog.set_level(logging.WARNING, logger="lightning_spec.tracking")
    logger = SpecMLFlowLogger(experiment_name="fit", run_dir=str(run_dir), tracking_uri=server.uri)
    checkpoint = ModelCheckpoint(save_last=True)
    trainer = Trainer(
        accelerator="cpu",
        max_steps=3,
        log_every_n_steps=1,
        logger=logger,
        callbacks=[checkpoint, KillServer()],
        default_root_dir=str(run_dir),
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = DataLoader(TensorDataset(torch.randn(6, 2)), batch_size=2)
    trainer.fit(Tiny(), data)

    assert trainer.global_step == 3 and logger.offline
    assert Path(checkpoint.last_model_path).is_file()
    assert logger.run_id in checkpoint.last_model_path  # <run_dir>/<experiment>/<run>/...
    assert len(_offline_warnings(caplog)) == 1
    records, _ = read_mirror(run_dir)
    steps = sorted({r["step"] for r in records if "train/loss" in r.get("metrics", {})})
    assert steps == [0, 1, 2]
    assert records[-1] == {**records[-1], "type": "end", "status": "FINISHED"}

    # The server stays down: write straight into its database.
    assert _relog(str(run_dir), "--tracking-uri", f"sqlite:///{server.db}") == 0
    client = MlflowClient(f"sqlite:///{server.db}")
    history = client.get_metric_history(logger.run_id, "train/loss")
    assert sorted(m.step for m in history) == [0, 1, 2]
    assert client.get_run(logger.run_id).info.status == "FINISHED"
    assert json.loads((run_dir / MIRROR_NAME).read_text().splitlines()[-1])["type"] == "relog"


KILLED_SCRIPT = """
import os, signal, sys
from lightning_spec.tracking import make_mlflow_logger
logger = make_mlflow_logger("killed", sys.argv[1])
logger.log_metrics({"loss": 1.0}, step=0)
print(logger.run_id, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no finalize: the run would stay RUNNING
"""


def test_a_killed_runs_mlflow_status_is_set_by_the_next_session(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process killed mid-run (SIGKILL) cannot close its MLflow run; the next logger session
    in the same run folder finds it RUNNING with its process gone and marks it KILLED, without
    touching its own run."""
    import subprocess
    import sys

    from mlflow.tracking import MlflowClient

    from lightning_spec.tracking import default_tracking_uri, make_mlflow_logger

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = tmp_path / "runs" / "job"
    done = subprocess.run([sys.executable, "-c", KILLED_SCRIPT, str(run_dir)],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == -9, done.stderr[-2000:]
    killed = done.stdout.strip().splitlines()[-1]
    client = MlflowClient(tracking_uri=default_tracking_uri(run_dir))
    assert client.get_run(killed).info.status == "RUNNING"
    logger = make_mlflow_logger("killed", run_dir)
    logger.log_metrics({"loss": 0.5}, step=0)
    assert client.get_run(killed).info.status == "KILLED"
    assert client.get_run(logger.run_id).info.status == "RUNNING"
    logger.finalize("success")
    assert client.get_run(logger.run_id).info.status == "FINISHED"
    again = make_mlflow_logger("killed", run_dir)  # a third session: nothing left to mark
    again.log_metrics({"loss": 0.1}, step=0)
    again.finalize("success")
    records = [
        json.loads(line) for line in (run_dir / "mlflow_mirror.jsonl").read_text().splitlines()
    ]
    marks = [r for r in records if r["type"] == "killed_run"]
    assert [m["run_id"] for m in marks] == [killed]


# --------------------------------------------------------------------------- disk full, locks


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs Linux's /dev/full (ENOSPC)")
def test_a_full_disk_costs_neither_the_run_nor_the_mirror(
    tmp_path: Path, store: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The mirror's file on a full disk (a symlink to /dev/full: every write fails with ENOSPC,
    a real fault, no mock): logging goes on (MLflow still gets every metric), the records wait
    in memory, the error says so once, and when space returns they are all written, in order."""
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "runs" / "full"
    logger = SpecMLFlowLogger(experiment_name="full", run_dir=str(run_dir), tracking_uri=store)
    logger.log_metrics({"train/loss": 1.0}, step=0)
    mirror = run_dir / MIRROR_NAME
    kept = mirror.read_bytes()
    mirror.unlink()
    mirror.symlink_to("/dev/full")
    with caplog.at_level(logging.ERROR, logger="lightning_spec"):
        for step in range(1, 4):
            logger.log_metrics({"train/loss": 1.0 / (step + 1)}, step=step)
    assert logger.mirror.pending == 3 and not logger.offline
    assert sum("is full" in r.getMessage() for r in caplog.records) == 1  # said once
    client = MlflowClient(logger._tracking_uri)
    assert len(client.get_metric_history(logger.run_id, "train/loss")) == 4  # MLflow got all

    mirror.unlink()  # space is back
    mirror.write_bytes(kept)
    logger.log_metrics({"train/loss": 0.1}, step=4)
    logger.finalize("success")
    records, bad = read_mirror(run_dir)
    assert bad == 0 and logger.mirror.pending == 0
    steps = [r["step"] for r in records if r["type"] == "metrics"]
    assert steps == [0, 1, 2, 3, 4]
    assert [r["seq"] for r in records] == list(range(len(records)))


def test_a_locked_sqlite_store_is_waited_for_not_abandoned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Another connection holds the SQLite store's write lock past MLflow's 20 s busy timeout
    (a real lock, `BEGIN EXCLUSIVE`): the logger retries instead of going offline, and the
    metric lands once the lock is released."""
    import sqlite3
    import threading

    from mlflow.tracking import MlflowClient

    database = tmp_path / "mlflow.db"
    uri = f"sqlite:///{database}"
    logger = SpecMLFlowLogger(
        experiment_name="locked", run_dir=str(tmp_path / "r"), tracking_uri=uri
    )
    logger.log_metrics({"train/loss": 1.0}, step=0)  # creates the store and the run
    holder = sqlite3.connect(database, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN EXCLUSIVE")
    release = threading.Timer(21.0, lambda: holder.execute("COMMIT"))
    release.start()
    try:
        with caplog.at_level(logging.INFO, logger="lightning_spec"):
            logger.log_metrics({"train/loss": 0.5}, step=1)
    finally:
        release.join()
        holder.close()
    assert not logger.offline
    assert any("locked" in r.getMessage() and "retry" in r.getMessage() for r in caplog.records)
    history = MlflowClient(uri).get_metric_history(logger.run_id, "train/loss")
    assert sorted(m.step for m in history) == [0, 1]
    logger.finalize("success")
