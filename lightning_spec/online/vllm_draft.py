"""Push a new drafter into a running vLLM engine, all or nothing (OnlineSpec inside vLLM).

This file runs inside vLLM's own interpreter (the worker process that holds the draft model) as
well as ours, so it imports only the standard library, torch and safetensors; vLLM itself is
imported inside the one function that needs it.

Why not vLLM's weight-transfer engines: `start_draft_weight_update` (vLLM 0.32) needs a
transfer engine, and every engine 0.32 ships moves tensors over CUDA IPC or NCCL; the CPU
worker has none (`supports_draft_weight_updates()` is False there). The CPU path is
`LLM.collective_rpc` into the worker with `reload_draft`, which runs vLLM's own in-place reload
(`initialize_layerwise_reload` -> the draft model's `load_weights` -> `finalize_layerwise_reload`)
on the draft model only. The reload matters on CPU: vLLM prepacks every linear weight for oneDNN
after loading and frees the original, so copying into parameters would change nothing served.

The guarantees, each tested on our side without vLLM:
- A drafter is read, checked (sha256 of the file as pushed, every tensor finite, the same
  tensor names and shapes as the drafter being served) and only then loaded: a truncated file,
  a NaN drafter or one of another shape is refused with the engine untouched.
- A load that fails part-way is undone by loading the previous drafter's file again, so the
  engine serves the previous drafter, never a half-written one; the push then raises.
- Requests are served between pushes, never during one: `LLM.collective_rpc` runs between
  engine steps and the online loop pushes between rounds.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

WEIGHTS = "model.safetensors"

__all__ = [
    "DraftRejected",
    "DrafterFile",
    "read_drafter",
    "push_drafter",
    "reload_draft",
]


class DraftRejected(ValueError):
    """The pushed drafter was refused before the engine was touched."""


class DrafterFile:
    """A drafter folder's weights, read and checked: the tensors in file order and the file's
    sha256 (the version the engine reports as served)."""

    def __init__(self, folder: Path, sha256: str, tensors: list[tuple[str, torch.Tensor]]) -> None:
        self.folder = folder
        self.sha256 = sha256
        self.tensors = tensors

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(t.shape) for name, t in self.tensors}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_drafter(folder: str | Path, sha256: str | None = None) -> DrafterFile:
    """Read `folder`/model.safetensors and check it; `DraftRejected` says why not.

    `sha256` is the digest the sender computed after writing the file: a file changed or cut
    since (a writer killed mid-write, a second writer) does not match it."""
    from safetensors.torch import load_file

    folder = Path(folder)
    path = folder / WEIGHTS
    if not path.is_file():
        raise DraftRejected(f"{path} does not exist")
    digest = _sha256(path)
    if sha256 is not None and digest != sha256:
        raise DraftRejected(f"{path}: sha256 {digest[:12]} is not the pushed {sha256[:12]}")
    try:
        state = load_file(str(path))
    except Exception as error:  # safetensors' own error type differs between versions
        raise DraftRejected(f"{path} is not a readable safetensors file: {error}") from error
    for name, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise DraftRejected(f"{path}: {name} holds NaN or inf")
    return DrafterFile(folder, digest, list(state.items()))


def check_compatible(new: DrafterFile, served: DrafterFile) -> None:
    """The engine was built for `served`'s tensors; another set would load partly or not at all."""
    old, fresh = served.shapes(), new.shapes()
    if old.keys() != fresh.keys():
        missing, extra = sorted(old.keys() - fresh.keys()), sorted(fresh.keys() - old.keys())
        raise DraftRejected(
            f"tensor names differ from the served drafter: missing {missing[:4]}, extra {extra[:4]}"
        )
    changed = [n for n in old if old[n] != fresh[n]]
    if changed:
        name = changed[0]
        raise DraftRejected(
            f"{len(changed)} tensors change shape (e.g. {name}: {old[name]} -> {fresh[name]}); "
            "a new draft vocabulary size or architecture needs a new engine"
        )


def push_drafter(
    load: Callable[[Iterable[tuple[str, torch.Tensor]]], Any],
    new: DrafterFile,
    served: DrafterFile,
) -> DrafterFile:
    """Load `new` with `load` in place of `served`, all or nothing; returns the drafter now served.

    `load` is what puts a complete set of tensors into the engine (`reload_draft` in vLLM). If it
    fails, `served` is loaded again and the error re-raised: the engine keeps serving the drafter
    it served before."""
    check_compatible(new, served)
    try:
        load(iter(new.tensors))
    except BaseException as error:
        try:
            load(iter(served.tensors))
        except BaseException as restore_error:  # the engine's state is unknown: say so loudly
            raise RuntimeError(
                f"pushing {new.sha256[:12]} failed ({error!r}) and restoring {served.sha256[:12]} "
                f"failed too ({restore_error!r}): restart the engine"
            ) from restore_error
        raise
    return new


def reload_draft(worker: Any, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """In vLLM's worker: load `tensors` (checkpoint names, as in the drafter folder) into the
    speculative draft model with vLLM's in-place layerwise reload; returns the tensors loaded."""
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    model = worker.get_draft_model()
    spec = getattr(worker, "speculative_config", None) or worker.vllm_config.speculative_config
    if model is None or spec is None or spec.draft_model_config is None:
        raise RuntimeError("this vLLM engine has no draft model to update")
    count = 0

    def counted() -> Iterable[tuple[str, torch.Tensor]]:
        nonlocal count
        for item in tensors:
            count += 1
            yield item

    with torch.no_grad():
        initialize_layerwise_reload(model)
        model.load_weights(counted())
        finalize_layerwise_reload(model, spec.draft_model_config)
    return count
