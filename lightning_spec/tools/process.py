"""A server we started in a child process (llama-server, vllm serve): wait until it answers.

One rule for every engine we launch: poll ``GET /health`` until it answers 200, and stop waiting
at once when the process has exited (its log then says why) or after `timeout` seconds.
"""

from __future__ import annotations

import subprocess
import time
import urllib.error
import urllib.request

__all__ = ["ServerExited", "wait_healthy"]


class ServerExited(RuntimeError):
    """The server process exited before it answered ``/health``."""


def wait_healthy(process: subprocess.Popen, url: str, timeout: float, *, poll: float = 0.5) -> None:
    """Return once ``url/health`` answers 200; `ServerExited` when `process` exits first,
    `TimeoutError` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerExited(f"exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(poll)
    raise TimeoutError(f"no answer from {url}/health after {timeout:.0f} s")
