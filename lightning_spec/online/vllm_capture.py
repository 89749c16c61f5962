"""Our vLLM plugin, engine side: capture what the target computed while serving, and take pushes.

`LightningSpecWorker` is a vLLM worker extension (``vllm serve --worker-extension-cls
lightning_spec.online.vllm_capture.LightningSpecWorker``): vLLM mixes it into its worker, and
its methods are reached with ``collective_rpc`` by name (our endpoint plugin,
`online.vllm_routes`, calls them from the API server). Nothing of vLLM is patched on disk.

* ``lightning_spec_start_capture(spool)`` wraps this worker's model runner: every step, before
  the drafter proposes, the target's aux hidden states (the EAGLE-3 layers), its final hidden
  states, the step's input token ids and its sampled tokens are handed to
  `online.capture.StepCapture`, which keeps the rows of the committed text per request; a
  finished request (its last token sampled: an end token, a stop token or its length limit;
  or named finished by the scheduler) goes to a background thread that writes it to the spool
  (`online.spool.SpoolWriter`). Anything that goes wrong in capture is counted and capture
  turns itself off; serving never sees an exception from it.
* ``lightning_spec_push(folder, sha256)`` replaces the draft model's weights all or nothing
  (`online.vllm_draft`: the file's sha256, finite tensors, the served drafter's names and
  shapes, then vLLM's in-place reload; a failed load restores the previous weights).
* ``lightning_spec_status()`` says what is served and what capture did.

This module runs in vLLM's interpreter: it imports the standard library, torch and our
engine-side modules (`capture`, `spool`, `vllm_draft`), which import nothing else of ours.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from lightning_spec.online.capture import StepCapture
from lightning_spec.online.spool import SpoolWriter
from lightning_spec.online.vllm_draft import (
    WEIGHTS,
    DraftRejected,
    push_drafter,
    read_drafter,
    reload_draft,
)

log = logging.getLogger(__name__)

__all__ = ["LightningSpecWorker", "RunnerCapture"]

PLACEHOLDER = -1  # vLLM's sampled-token padding for rejected positions


class RunnerCapture:
    """The capture state of one model runner, fed by its wrapped methods."""

    def __init__(self, spool: str | Path, *, queue_size: int = 256) -> None:
        self.steps = StepCapture()
        self.writer = SpoolWriter(spool)
        self.counts: Counter[str] = Counter()
        self.enabled = True
        self.error: str | None = None
        self._done_early: set[str] = set()
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=queue_size)
        self._thread = threading.Thread(
            target=self._write_loop, name="lightning-spec-spool", daemon=True
        )
        self._thread.start()

    # -- called from the runner ------------------------------------------------------------
    def observe(self, runner: Any, scheduler_output: Any, sampled_token_ids: Any,
                hidden_states: Any, aux_hidden_states: Any) -> None:  # fmt: skip
        """One step, before the drafter proposes. Never raises."""
        if not self.enabled:
            return
        try:
            self._observe(
                runner, scheduler_output, sampled_token_ids, hidden_states, aux_hidden_states
            )
        except Exception as error:  # noqa: BLE001 - serving must never see capture fail
            self._trip(error)

    def finished(self, request_ids: Any) -> None:
        """Requests the scheduler says are finished (or aborted). Never raises."""
        if not self.enabled:
            return
        try:
            for request_id in request_ids or ():
                if request_id in self._done_early:
                    self._done_early.discard(request_id)
                    continue
                self._hand_over(self.steps.finish(request_id))
        except Exception as error:  # noqa: BLE001
            self._trip(error)

    def status(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled, "error": self.error, "running": len(self.steps.running),
            **{f"capture_{k}": v for k, v in self.counts.items()},
            **{f"skipped_{k}": v for k, v in self.steps.skipped.items()},
            **{f"spool_{k}": v for k, v in self.writer.counts.items()},
            "spool": str(self.writer.folder),
        }  # fmt: skip

    # -- internals -------------------------------------------------------------------------
    def _observe(
        self, runner: Any, scheduler_output: Any, sampled: Any, hidden: Any, aux: Any
    ) -> None:
        if aux is None:
            raise RuntimeError("the engine computes no aux hidden states (not an EAGLE-3 drafter?)")
        batch = runner.input_batch
        request_ids = list(batch.req_ids)
        count = len(request_ids)
        starts = runner.query_start_loc.cpu[: count + 1].tolist()
        total = starts[-1]
        inputs = runner.input_ids.gpu[:total].to("cpu", torch.long).tolist()
        rows = torch.cat([h[:total] for h in aux], dim=-1).to("cpu", torch.float32)
        last = hidden[:total].to("cpu", torch.float32)
        if isinstance(sampled, torch.Tensor):
            sampled = sampled.to("cpu").tolist()
        discard = runner.discard_request_mask.cpu[:count].tolist()
        for i, request_id in enumerate(request_ids):
            if request_id in self._done_early:
                continue
            lo, hi = starts[i], starts[i + 1]
            kept = [] if discard[i] else [int(t) for t in sampled[i] if int(t) != PLACEHOLDER]
            self.steps.add_step(request_id, inputs[lo:hi], rows[lo:hi], kept, last=last[lo:hi])
            self.counts["steps"] += 1
            if kept and self._ends(runner, request_id, kept):
                self._done_early.add(request_id)
                self._hand_over(self.steps.finish(request_id))

    def _ends(self, runner: Any, request_id: str, sampled: list[int]) -> bool:
        """Whether the scheduler will finish this request on these tokens (vLLM's stop rule:
        an end or stop token once `min_tokens` are out, the length limit, the model's length)."""
        state = runner.requests.get(request_id)
        params = getattr(state, "sampling_params", None)
        capture = self.steps.running.get(request_id)
        if params is None or capture is None:
            return False
        served = capture.served_tokens()
        out = served - capture.prompt_len
        stops = set(params.stop_token_ids or ())
        if getattr(params, "eos_token_id", None) is not None:
            stops.add(params.eos_token_id)
        if out >= (params.min_tokens or 0) and any(t in stops for t in sampled):
            return True
        max_tokens = params.max_tokens
        return (max_tokens is not None and out >= max_tokens) or served >= runner.max_model_len

    def _hand_over(self, request: Any) -> None:
        if request is None:
            return
        try:
            self._queue.put_nowait(request)
            self.counts["finished"] += 1
        except queue.Full:
            self.counts["dropped_queue_full"] += 1

    def _write_loop(self) -> None:
        while True:
            request = self._queue.get()
            self.writer.put(request)

    def _trip(self, error: BaseException) -> None:
        self.enabled = False
        self.error = repr(error)
        self.counts["errors"] += 1
        log.error("lightning-spec capture turned off after %r; serving goes on", error)


class LightningSpecWorker:
    """Methods mixed into vLLM's worker (``--worker-extension-cls``); see the module docstring."""

    def lightning_spec_start_capture(self, spool: str) -> dict[str, Any]:
        runner = self.model_runner  # type: ignore[attr-defined]
        if getattr(runner, "_lightning_spec_capture", None) is not None:
            return runner._lightning_spec_capture.status()
        capture = RunnerCapture(spool)
        propose, update = runner.propose_draft_token_ids, runner._update_states

        def propose_and_capture(scheduler_output, sampled_token_ids, sampling_metadata,
                                hidden_states, sample_hidden_states, aux_hidden_states,
                                *args, **kwargs):  # fmt: skip  # noqa: ANN001, ANN202
            capture.observe(
                runner, scheduler_output, sampled_token_ids, hidden_states, aux_hidden_states
            )
            return propose(scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                           sample_hidden_states, aux_hidden_states, *args, **kwargs)  # fmt: skip

        def update_and_finish(scheduler_output, *args, **kwargs):  # noqa: ANN001, ANN202
            capture.finished(getattr(scheduler_output, "finished_req_ids", ()))
            capture.finished(getattr(scheduler_output, "preempted_req_ids", None) or ())
            return update(scheduler_output, *args, **kwargs)

        runner.propose_draft_token_ids = propose_and_capture
        runner._update_states = update_and_finish
        runner._lightning_spec_capture = capture
        return capture.status()

    def lightning_spec_status(self) -> dict[str, Any]:
        runner = self.model_runner  # type: ignore[attr-defined]
        capture = getattr(runner, "_lightning_spec_capture", None)
        served = getattr(self, "_lightning_spec_served", None)
        return {
            "served_sha256": served.sha256 if served is not None else None,
            "served_folder": str(served.folder) if served is not None else self._lightning_spec_initial(),
            "capture": capture.status() if capture is not None else {"enabled": False},
        }  # fmt: skip

    def lightning_spec_push(self, folder: str, sha256: str) -> dict[str, Any]:
        """Serve the drafter in `folder` if its file has `sha256` and the served drafter's
        tensors; otherwise raise (the previous drafter keeps serving)."""
        tic = time.perf_counter()
        served = getattr(self, "_lightning_spec_served", None)
        if served is None:
            served = read_drafter(self._lightning_spec_initial())
        new = read_drafter(folder, sha256)
        self._lightning_spec_served = push_drafter(lambda t: reload_draft(self, t), new, served)
        return {"served_sha256": new.sha256, "seconds": time.perf_counter() - tic}

    def _lightning_spec_initial(self) -> str:
        spec = self.vllm_config.speculative_config  # type: ignore[attr-defined]
        if spec is None or not spec.model:
            raise DraftRejected("this engine serves no drafter")
        folder = Path(spec.model)
        if not (folder / WEIGHTS).is_file():
            raise DraftRejected(f"the served drafter {folder} has no {WEIGHTS}")
        return str(folder)
