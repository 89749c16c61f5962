"""Integration: a real `mlflow server` (SQLite backend, proxied artifacts) started here.

Two drafters of different quality for a tiny target, measured for real with `run_bench`: an
untrained EAGLE-3 head and the target drafting for itself. The first registered becomes
champion; the better one, registered without figures, is re-measured side by side with the
champion and takes the alias; the old champion, promoted again, is compared on the stored
figures and becomes challenger. `models:/NAME@champion` then loads and decodes losslessly.
The server is stopped by the fixture whatever happens; when it cannot start, the test skips
with the tail of its stderr.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from lightning_spec.decoding.build import parse_tree_spec
from lightning_spec.decoding.engine import SpeculativeDecoder, autoregressive_generate
from lightning_spec.models.drafters.base import load_drafter
from lightning_spec.models.target import TargetModel
from lightning_spec.registry import (
    bench_measure,
    drafter_metadata,
    load_registered_drafter,
    promote,
    register_drafter,
    registry_client,
)

STARTUP_SECONDS = 90
CONDITIONS = {"prompt_set": "toy", "tree": "chain:3", "max_new_tokens": 12}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tail(path: Path, lines: int = 15) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("server")
    port = _free_port()
    log = root / "server.log"
    command = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        f"sqlite:///{root / 'mlflow.db'}",
        "--artifacts-destination",
        str(root / "artifacts"),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    # The registry needs no server-side jobs: no job runner and huey workers competing for CPU.
    env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
    with open(log, "wb") as output:
        process = subprocess.Popen(
            command, stdout=output, stderr=subprocess.STDOUT, cwd=root, env=env
        )
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_SECONDS
        while True:
            if process.poll() is not None:
                pytest.skip(f"mlflow server exited with {process.returncode}:\n{_tail(log)}")
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.skip(f"mlflow server not healthy after {STARTUP_SECONDS} s:\n{_tail(log)}")
            time.sleep(0.25)
        yield uri
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def _never(drafters: dict) -> dict:
    raise AssertionError("the stored figures are comparable: nothing should be measured")


def test_better_drafter_becomes_champion_on_a_real_server(
    server: str, target: TargetModel, folders: dict[str, Path], prompts: list[list[int]]
) -> None:
    name = "server-drafter"
    client = registry_client(server)
    measure = bench_measure(target, prompts, prompt_set="toy", tree="chain:3", max_new_tokens=12)
    random_tau = measure({"candidate": load_drafter(folders["random"])})["candidate"]

    metadata = drafter_metadata(
        folders["random"],
        taus={("toy", 0): random_tau},
        tree="chain:3",
        max_new_tokens=12,
        objective="none",
    )
    weak = register_drafter(folders["random"], name, tracking_uri=server, metadata=metadata)
    first = promote(name, weak.version, tracking_uri=server, run_id=weak.run_id, **CONDITIONS)
    assert first.promoted and first.champion_version is None

    strong = register_drafter(
        folders["self"],
        name,
        tracking_uri=server,
        metadata=drafter_metadata(folders["self"], tree="chain:3", max_new_tokens=12),
    )
    second = promote(
        name,
        strong.version,
        tracking_uri=server,
        run_id=strong.run_id,
        target=target,
        prompts=prompts,
        **CONDITIONS,
    )
    assert second.remeasured and second.promoted
    assert second.champion_tau == pytest.approx(random_tau)
    assert second.candidate_tau > second.champion_tau + 0.05
    assert second.candidate_tau > 2.5  # the target drafting for itself: nearly k + 1 = 4

    third = promote(name, weak.version, tracking_uri=server, measure=_never, **CONDITIONS)
    assert third.comparable and third.outcome == "challenger"
    aliases = {k: str(v) for k, v in client.get_registered_model(name).aliases.items()}
    assert aliases == {"champion": str(strong.version), "challenger": str(weak.version)}
    tags = client.get_model_version(name, str(strong.version)).tags
    assert tags["promotion/outcome"] == "champion" and tags["promotion/remeasured"] == "true"
    run = client.get_run(strong.run_id)
    assert run.data.metrics["promotion/promoted"] == 1.0

    drafter = load_registered_drafter(f"models:/{name}@champion", tracking_uri=server)
    assert type(drafter).__name__ == "StandaloneDrafter"
    decoder = SpeculativeDecoder(target, drafter, parse_tree_spec("chain:3"))
    for prompt in prompts:
        expected = autoregressive_generate(target, prompt, 12, stop_on_eos=False)
        assert decoder.generate(prompt, 12, stop_on_eos=False).tokens == expected


RACE_SCRIPT = """
import json, sys, time
from pathlib import Path
from lightning_spec.registry import promotion

uri, name, version, go = sys.argv[1:5]
real = promotion._apply

def slow(client, decision):  # decide, then take long enough to move the alias for a race
    time.sleep(1.5)
    real(client, decision)

promotion._apply = slow
while not Path(go).exists():
    time.sleep(0.01)
decision = promotion.promote(name, version, tracking_uri=uri, prompt_set="toy", tree="chain:3",
                             max_new_tokens=12, measure=lambda d: {})
print(json.dumps({"outcome": decision.outcome, "against": decision.champion_version}))
"""


def test_two_promotions_at_once_cannot_both_win(
    server: str, folders: dict[str, Path], tmp_path: Path
) -> None:
    """Two real processes promote a better and a best candidate at the same moment against the
    same champion on a real server: the best ends up champion whichever moves first (the
    second re-decides against the new champion under the promotion lock)."""
    import json

    name = "race-drafter"

    def version(tau: float) -> str:
        metadata = drafter_metadata(folders["random"], taus={("toy", 0): tau}, tree="chain:3",
                                    max_new_tokens=12, objective="none")  # fmt: skip
        return str(register_drafter(folders["random"], name, tracking_uri=server,
                                    metadata=metadata).version)  # fmt: skip

    champion = version(1.5)
    assert promote(name, champion, tracking_uri=server, **CONDITIONS).promoted
    better, best = version(2.0), version(2.5)
    go = tmp_path / "go"
    env = {**os.environ, "LIGHTNING_SPEC_CACHE": str(tmp_path / "cache")}
    workers = [
        subprocess.Popen([sys.executable, "-c", RACE_SCRIPT, server, name, v, str(go)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for v in (better, best)
    ]  # fmt: skip
    time.sleep(2.0)  # both imported and waiting
    go.write_text("go")
    results = []
    for worker in workers:
        out, err = worker.communicate(timeout=180)
        assert worker.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    aliases = {k: str(v) for k, v in registry_client(server).get_registered_model(name).aliases.items()}
    assert aliases["champion"] == best
    against = {r["against"] for r in results}
    assert champion in against and len(against) == 2  # the later one decided again
