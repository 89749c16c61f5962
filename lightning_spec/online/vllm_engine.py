"""A running vLLM engine serving our drafter, whose drafter we can replace between rounds.

vLLM pins its own torch, so the engine lives in a worker process under vLLM's interpreter
(`online/vllm_worker.py`) and this class talks to it in JSON lines. The engine runs
in-process in that worker (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that the push
(`LLM.collective_rpc` with `vllm_draft.reload_draft`) reaches the draft model without
serializing code; see `online/vllm_draft.py` for why the CPU build needs that path.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_spec.bench.engines import PromptResult
from lightning_spec.bench.vllm import to_prompt_results, vllm_mode
from lightning_spec.io import sha256_file
from lightning_spec.online.engines import PushFailed
from lightning_spec.tools.vllm import VllmEnv

__all__ = ["VllmOnlineEngine"]

WORKER = Path(__file__).with_name("vllm_worker.py")


class VllmOnlineEngine:
    """vLLM serving `drafter` (EAGLE-3 at `k` drafts a step, T = 0) until `close`: a
    `online.engines.ServingEngine`."""

    def __init__(
        self,
        env: VllmEnv,
        target: Path,
        drafter: Path,
        *,
        k: int = 3,
        method: str = "eagle3",
        log: Path,
        max_model_len: int = 2048,
        enforce_eager: bool = True,
    ) -> None:
        environ = env.environ()
        environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self.log_path = log
        self._log = open(log, "w")
        self._process = subprocess.Popen(
            [str(env.python), str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._log, env=environ, text=True, bufsize=1,
        )  # fmt: skip
        spec = {
            "target": str(target), "dtype": "float32", "max_model_len": max_model_len,
            "enforce_eager": enforce_eager, "seed": 0,
            "mode": vllm_mode(method, drafter=drafter, k=k),
        }  # fmt: skip
        self.name = spec["mode"]["name"]
        ready = self._ask(spec)
        self.served: str = ready["served"]

    def _ask(self, payload: dict[str, Any]) -> dict[str, Any]:
        if self._process.poll() is not None:
            raise RuntimeError(f"the vLLM worker has exited ({self._process.returncode}); log: {self.log_path}")
        self._process.stdin.write(json.dumps(payload) + "\n")
        self._process.stdin.flush()
        line = self._process.stdout.readline()
        if not line:
            code = self._process.wait()
            raise RuntimeError(f"the vLLM worker exited with {code}; log: {self.log_path}")
        return json.loads(line)

    def serve(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[PromptResult]:
        """Every prompt one at a time, greedy, with the drafter now served."""
        answer = self._ask(
            {"op": "serve", "prompts": [[int(t) for t in p] for p in prompts], "max_new_tokens": max_new_tokens}
        )
        return to_prompt_results({"modes": {self.name: {"prompts": answer["results"]}}})[self.name]

    def push(self, folder: Path) -> float:
        """Serve the drafter in `folder` from now on (its file complete: hashed here, checked
        there); its seconds. `PushFailed` when refused or not loaded: the previous one serves."""
        digest = sha256_file(Path(folder) / "model.safetensors")
        folder = Path(folder).expanduser().resolve()  # the worker's folder is not ours
        answer = self._ask({"op": "push", "folder": str(folder), "sha256": digest})
        if not answer.get("ok"):
            self.served = answer.get("served", self.served)
            raise PushFailed(answer.get("rejected") or answer.get("error") or "push failed")
        self.served = answer["served"]
        return float(answer["seconds"])

    def close(self) -> None:
        if self._process.poll() is None:
            try:
                self._process.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self._process.stdin.flush()
                self._process.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self._process.kill()
        self._log.close()

    def __enter__(self) -> VllmOnlineEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
