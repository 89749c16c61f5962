"""llama.cpp in the loop: plain decoding, our drafter and llama.cpp's own speculation, side by side.

On a CPU the peer a user would actually pick is llama.cpp, not HF ``generate``. This module
runs one ``llama-server`` per mode (same target GGUF, same threads), sends every prompt to every
mode in rotating order (so drift on a shared machine spreads evenly), and keeps llama.cpp's own
figures per prompt: generated tokens, decode time, drafted and accepted tokens. Prompts go in as
token ids from the target's tokenizer and chat template, exactly what our own bench feeds our
decoder, so acceptance can be compared across engines.

Modes (`Mode`): ``plain`` (no speculation), ``eagle3`` (our drafter, ``draft-eagle3``),
``self`` (the target drafting for itself with ``draft-simple``: the same batched-verification
numerics with every draft right, the reference for llama.cpp's own near-tie flips) and
``ngram-*`` (llama.cpp's drafter-free spec types).

The per-prompt result, the summary (tok/s, speedup, tau, mismatches) and the chain pick are the
engine-neutral ones of `bench/engines.py`, which the vLLM bench shares.
"""

from __future__ import annotations

import json
import socket
import subprocess
import urllib.error
import urllib.request
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_spec.bench.engines import PromptResult
from lightning_spec.tools.process import ServerExited, wait_healthy

__all__ = ["NGRAM_TYPES", "LlamaServer", "Mode", "mode_args", "run_modes"]

NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")


@dataclass(frozen=True)
class Mode:
    """One llama-server configuration: a label and the arguments beyond target and threads."""

    name: str
    args: tuple[str, ...] = ()


def mode_args(
    name: str,
    *,
    drafter_gguf: Path | None = None,
    target_gguf: Path | None = None,
    n_max: int = 4,
    p_min: float = 0.0,
) -> Mode:
    """The `Mode` for ``plain``, ``eagle3``, ``dflash``, ``self`` or an ngram spec type.

    `n_max` is the chain length (``--spec-draft-n-max``; a DFlash drafter fills a block of
    `n_max` + 1, so serve it at its block size - 1, as it was trained); `p_min` (``--spec-draft-p-min``)
    stops a chain early when the drafter's top probability falls below it (0: always draft
    `n_max`, which is what our ``chain:K`` does).
    """
    draft = ("--spec-draft-n-max", str(n_max), "--spec-draft-p-min", f"{p_min:g}")
    if name == "plain":
        return Mode(name)
    if name in ("eagle3", "dflash"):
        if drafter_gguf is None:
            raise ValueError(f"mode {name} needs the drafter's GGUF")
        return Mode(f"{name}@{n_max}", ("-md", str(drafter_gguf), "--spec-type", f"draft-{name}", *draft))
    if name == "self":
        if target_gguf is None:
            raise ValueError("mode self needs the target's GGUF")
        return Mode(f"self@{n_max}", ("-md", str(target_gguf), "--spec-type", "draft-simple", *draft))
    if name in NGRAM_TYPES:
        return Mode(name, ("--spec-type", name))
    raise ValueError(f"unknown mode {name!r}: plain, eagle3, dflash, self or one of {NGRAM_TYPES}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LlamaServer:
    """A ``llama-server`` process for one mode, started on a free loopback port."""

    def __init__(
        self,
        binary: Path,
        target_gguf: Path,
        mode: Mode,
        *,
        threads: int = 2,
        context: int = 2048,
        log: Path | None = None,
        startup_timeout: float = 300.0,
    ) -> None:
        self.mode = mode
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [
            str(binary), "-m", str(target_gguf), "--host", "127.0.0.1", "--port", str(self.port),
            "-t", str(threads), "-tb", str(threads), "-c", str(context), "-np", "1",
            *mode.args,
        ]
        if "-md" in mode.args:
            command += ["-td", str(threads), "-tbd", str(threads)]
        self.command = command
        self._log = open(log, "w") if log is not None else subprocess.DEVNULL  # noqa: SIM115
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)
        self._wait(startup_timeout)

    def _wait(self, timeout: float) -> None:
        try:
            wait_healthy(self.process, self.url, timeout)
        except ServerExited as error:
            raise RuntimeError(f"llama-server ({self.mode.name}) {error}: {' '.join(self.command)}") from error
        except TimeoutError as error:
            self.close()
            raise TimeoutError(f"llama-server ({self.mode.name}) not ready after {timeout:.0f} s") from error

    def complete(self, prompt_ids: Sequence[int], max_new_tokens: int) -> dict[str, Any]:
        """Greedy completion of `prompt_ids`: llama.cpp's JSON (``tokens``, ``timings``)."""
        body = {
            "prompt": [int(t) for t in prompt_ids],
            "n_predict": int(max_new_tokens),
            "temperature": 0.0,
            "top_k": 1,
            "cache_prompt": False,
            "return_tokens": True,
            "stream": False,
        }
        request = urllib.request.Request(
            f"{self.url}/completion",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.loads(response.read())

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._log is not subprocess.DEVNULL:
            self._log.close()

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _parse(response: dict[str, Any]) -> PromptResult:
    timings = response.get("timings") or {}
    tokens = [int(t) for t in response.get("tokens") or []]
    return PromptResult(
        tokens=tokens,
        seconds=float(timings.get("predicted_ms", 0.0)) / 1000.0,
        drafted=int(timings.get("draft_n", 0) or 0),
        accepted=int(timings.get("draft_n_accepted", 0) or 0),
    )


def run_modes(
    binary: Path,
    target_gguf: Path,
    modes: Sequence[Mode],
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    threads: int = 2,
    warmup: int = 1,
    log_dir: Path | None = None,
    progress: bool = True,
) -> dict[str, list[PromptResult]]:
    """Every prompt through every mode (order rotated per prompt); results per mode."""
    results: dict[str, list[PromptResult]] = {m.name: [] for m in modes}
    with ExitStack() as stack:
        servers = []
        for mode in modes:
            log = None if log_dir is None else log_dir / f"server-{mode.name}.log"
            servers.append(
                stack.enter_context(
                    LlamaServer(binary, target_gguf, mode, threads=threads, log=log)
                )
            )
        for server in servers:  # first requests pay for page faults and allocations
            for _ in range(warmup):
                server.complete(prompts[0], min(max_new_tokens, 16))
        for index, prompt in enumerate(prompts):
            shift = index % len(servers)
            for server in servers[shift:] + servers[:shift]:
                results[server.mode.name].append(_parse(server.complete(prompt, max_new_tokens)))
            if progress:
                print(f"[llamacpp bench] prompt {index + 1}/{len(prompts)}", flush=True)
    return results
