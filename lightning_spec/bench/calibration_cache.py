"""`--tree auto` remembers its calibration per machine and drafter.

Calibrating (a cost curve and a drafter's acceptance profile) takes a minute or two on a CPU;
the answer only changes when the machine, the thread count, the dtype, whether the weights are
prepacked, the target or the drafter change. So the calibration is stored under
``$LIGHTNING_SPEC_CACHE/calibration/<key>.json`` with a key over exactly those, and reused
until one of them changes (``bench --recalibrate`` forces a fresh one).

Models are fingerprinted by their parameters' names, shapes and a sample of their values (the
first and last 256 of each tensor and its sum): a retrained drafter differs everywhere, and
hashing all 540 MB of a target on every bench would cost more than it saves.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "calibration_key",
    "load_calibration",
    "machine_fingerprint",
    "model_fingerprint",
    "save_calibration",
]

FORMAT = 1
SAMPLE = 256


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:  # pragma: no cover - not Linux
        pass
    return platform.processor() or platform.machine()


def machine_fingerprint(*, threads: int, dtype: str, prepacked: bool) -> dict[str, Any]:
    """What makes one machine's cost curve differ from another's."""
    device = "cpu"
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name(0)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS
        cores = os.cpu_count() or 1
    return {
        "cpu": _cpu_model(),
        "device": device,
        "cores": cores,
        "threads": int(threads),
        "dtype": str(dtype),
        "prepacked": bool(prepacked),
        "torch": torch.__version__,
    }


@torch.no_grad()
def model_fingerprint(module: nn.Module) -> str:
    """sha256 over every parameter's name, shape and a sample of its values (see module doc)."""
    digest = hashlib.sha256()
    for name, parameter in sorted(module.named_parameters(), key=lambda item: item[0]):
        flat = parameter.detach().reshape(-1).float().cpu()
        digest.update(f"{name}:{tuple(parameter.shape)}:{float(flat.sum()):.6e}".encode())
        digest.update(flat[:SAMPLE].numpy().tobytes())
        digest.update(flat[-SAMPLE:].numpy().tobytes())
    return digest.hexdigest()


def calibration_key(
    machine: dict[str, Any], target: nn.Module, drafter: nn.Module, settings: dict[str, Any]
) -> tuple[str, dict[str, Any]]:
    """(key, what it was computed from): `settings` holds the calibration's own knobs."""
    identity = {
        "format": FORMAT,
        "machine": machine,
        "target": model_fingerprint(target),
        "drafter": model_fingerprint(drafter),
        "settings": settings,
    }
    text = json.dumps(identity, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:24], identity


def _path(key: str, cache_dir: str | Path | None) -> Path:
    from lightning_spec.data.assets import cache_root

    return cache_root(cache_dir) / "calibration" / f"{key}.json"


def load_calibration(key: str, cache_dir: str | Path | None = None) -> dict[str, Any] | None:
    """The stored calibration for `key`, or None (missing, or unreadable: recalibrate)."""
    path = _path(key, cache_dir)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or "calibration" not in data:
        return None
    data["path"] = str(path)
    return data


def save_calibration(
    key: str,
    identity: dict[str, Any],
    calibration: dict[str, Any],
    cache_dir: str | Path | None = None,
) -> Path:
    """Write atomically (a killed bench leaves no torn file behind)."""
    from lightning_spec.io import atomic_write_json

    path = _path(key, cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, {"identity": identity, "calibration": calibration})
    return path
