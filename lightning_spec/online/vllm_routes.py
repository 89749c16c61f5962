"""Our vLLM plugin, HTTP side: routes on ``vllm serve``'s API server to push a drafter and read
what is served.

An endpoint plugin (entry point group ``vllm.endpoint_plugins``, name ``lightning_spec``; vLLM
loads it only when ``VLLM_PLUGINS`` names it), paired with the worker extension
`online.vllm_capture.LightningSpecWorker`, which holds the engine-side methods it calls with
``collective_rpc``. `lightning-spec serve --engine vllm` sets both up; see docs/vllm.md.

Routes (JSON):

* ``GET /lightning-spec/status``: the served drafter's sha256 and folder, capture counters, and
  ``learner_rounds``: how many rounds the learner writing into ``LIGHTNING_SPEC_PUSH_ROOT`` has
  finished. ``GET /lightning-spec/learner`` gives ``learner_rounds`` alone without calling the
  engine (a client that charges the learner in series polls it).
* ``POST /lightning-spec/push`` ``{"folder": ..., "sha256": ...}``: serve that drafter. Only a
  folder inside ``LIGHTNING_SPEC_PUSH_ROOT`` (the learner's output folder) is accepted: 403
  outside it, 404 without its weights, 409 when the engine refuses it (a wrong sha256, other
  tensor names or shapes, NaN weights: the previous drafter keeps serving).

At start (`init_state`) capture is switched on in the engine when ``LIGHTNING_SPEC_SPOOL`` names a
folder. The route logic sits in plain functions over an ``rpc`` callable so it is tested without
vLLM.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

# at module level: FastAPI reads the routes' annotations (strings here) from these globals
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

__all__ = [
    "ENV_PUSH_ROOT",
    "ENV_SPOOL",
    "LightningSpecRoutes",
    "PushRefused",
    "checked_push_folder",
]

ENV_SPOOL = "LIGHTNING_SPEC_SPOOL"
ENV_PUSH_ROOT = "LIGHTNING_SPEC_PUSH_ROOT"
WEIGHTS = "model.safetensors"

Rpc = Callable[..., Awaitable[Any]]


class PushRefused(Exception):
    """A push the server will not attempt (or the engine refused), with its HTTP status."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status, self.reason = status, reason


def checked_push_folder(body: Any, push_root: str | None) -> tuple[Path, str]:
    """The folder and sha256 of a push request, or `PushRefused` saying why not."""
    if not isinstance(body, dict) or not isinstance(body.get("folder"), str):
        raise PushRefused(400, 'the body must be JSON {"folder": ..., "sha256": ...}')
    sha256 = body.get("sha256")
    if (
        not isinstance(sha256, str)
        or len(sha256) != 64
        or not all(c in "0123456789abcdef" for c in sha256)
    ):
        raise PushRefused(400, "sha256 must be 64 lowercase hex digits")
    if not push_root:
        raise PushRefused(403, f"pushes are off: the server was started without {ENV_PUSH_ROOT}")
    root = Path(push_root).resolve()
    folder = Path(body["folder"]).resolve()
    if not folder.is_relative_to(root):
        raise PushRefused(403, f"{folder} is outside the learner's output folder {root}")
    if not (folder / WEIGHTS).is_file():
        raise PushRefused(404, f"{folder} holds no {WEIGHTS}")
    return folder, sha256


async def push(rpc: Rpc, body: Any, push_root: str | None) -> dict[str, Any]:
    """Check a push request and hand it to the engine (every worker: one answer each)."""
    folder, sha256 = checked_push_folder(body, push_root)
    try:
        answers = await rpc("lightning_spec_push", args=(str(folder), sha256))
    except Exception as error:  # the engine refused it or failed to load it: it serves the old one
        raise PushRefused(409, f"the engine kept its drafter: {error}") from error
    return answers[0] if isinstance(answers, list) and answers else answers


async def status(rpc: Rpc, push_root: str | None = None) -> dict[str, Any]:
    answers = await rpc("lightning_spec_status")
    answer = dict(answers[0] if isinstance(answers, list) and answers else answers)
    answer["learner_rounds"] = learner_rounds(push_root)
    return answer


def learner_rounds(push_root: str | None) -> int:
    """Rounds the learner has finished: the lines of its ``rounds.jsonl`` (`online.learner`),
    each appended once a round is checkpointed; 0 without a learner."""
    if not push_root:
        return 0
    try:
        with open(Path(push_root) / "rounds.jsonl", "rb") as handle:
            return sum(1 for line in handle if line.strip())
    except OSError:
        return 0


class LightningSpecRoutes:
    """The endpoint plugin vLLM instantiates (see the module docstring)."""

    name = "lightning_spec"
    required_tasks = None

    def attach_router(self, app: Any) -> None:
        router = APIRouter()

        def _rpc(request: Request) -> Rpc:
            client = getattr(request.app.state, "lightning_spec_engine", None)
            if client is None:
                raise PushRefused(503, "no engine behind this server")
            return client.collective_rpc

        @router.get("/lightning-spec/status")
        async def get_status(request: Request) -> Any:
            try:
                return JSONResponse(await status(_rpc(request), os.environ.get(ENV_PUSH_ROOT)))
            except PushRefused as refused:
                return JSONResponse({"error": refused.reason}, status_code=refused.status)

        @router.get("/lightning-spec/learner")
        async def get_learner() -> Any:
            # no engine call: a client waiting on the learner polls this, and every engine call
            # keeps vLLM's CPU worker busy-polling a core the learner needs
            return JSONResponse({"learner_rounds": learner_rounds(os.environ.get(ENV_PUSH_ROOT))})

        @router.post("/lightning-spec/push")
        async def post_push(request: Request) -> Any:
            try:
                body = await request.json()
            except Exception:  # noqa: BLE001 - any unreadable body is the client's error
                body = None
            try:
                answer = await push(_rpc(request), body, os.environ.get(ENV_PUSH_ROOT))
            except PushRefused as refused:
                return JSONResponse({"error": refused.reason}, status_code=refused.status)
            return JSONResponse(answer)

        app.include_router(router)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        state.lightning_spec_engine = engine_client
        spool = os.environ.get(ENV_SPOOL)
        if engine_client is not None and spool:
            await engine_client.collective_rpc("lightning_spec_start_capture", args=(spool,))
