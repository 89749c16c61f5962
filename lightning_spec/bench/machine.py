"""The machine a measurement ran on: cores, threads, versions, load average, git commit.

The project asks every published number to carry its context and to be taken on an idle
machine: `machine_info` records the context (and whether another job was running, `busy`),
`warn_if_busy` says so loudly, `git_commit` names the code that was measured.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

__all__ = ["cpu_flags", "git_commit", "has_native_bf16", "load_average", "machine_info", "warn_if_busy"]

SIMD_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
"""The /proc/cpuinfo flags that decide which CPU kernels run: the machines differ (Zen 3 has
avx2 only, Zen 4 adds avx512 and avx512_bf16), and bf16 matmuls are only fast with the last two."""


def cpu_flags() -> list[str]:
    """The SIMD flags of `SIMD_FLAGS` this CPU has (empty where /proc/cpuinfo is missing)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    line = next((row for row in text.splitlines() if row.startswith("flags")), "")
    have = set(line.split(":", 1)[-1].split())
    return [flag for flag in SIMD_FLAGS if flag in have]


def has_native_bf16() -> bool:
    """True where bf16 matmuls run natively on this CPU (avx512_bf16 or AMX), not emulated."""
    return bool({"avx512_bf16", "amx_bf16"} & set(cpu_flags()))


def load_average() -> tuple[float, float, float]:
    try:
        return os.getloadavg()
    except OSError:  # pragma: no cover - not available on every platform
        return (float("nan"),) * 3


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS
        return os.cpu_count() or 1


def machine_info(dtype: str = "fp32") -> dict[str, Any]:
    """Cores, threads, dtype, versions and the load average *before* the run starts.

    `busy` follows docs/benchmarking.md: the 1-minute load, less one runnable task for this process,
    above half the cores means another job shares the CPU and timings will be noisy.
    """
    import transformers

    load = load_average()
    cores = _cores()
    threshold = 0.5 * cores
    return {
        "cores": cores,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "dtype": dtype,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "processor": platform.processor() or platform.machine(),
        "cpu_flags": cpu_flags(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "load_average": [round(x, 2) for x in load],
        "load_threshold": threshold,
        "busy": bool(load[0] - 1.0 > threshold),
    }


def warn_if_busy(machine: dict[str, Any]) -> bool:
    """Print a loud warning when the load average says another job is running."""
    if not machine.get("busy"):
        return False
    load = machine["load_average"][0]
    bar = "!" * 78
    print(
        f"{bar}\nWARNING: 1-minute load average {load:.2f} on {machine['cores']} cores: another "
        f"job is using this machine (threshold: {machine['load_threshold']:.1f} beyond this "
        "process).\nWall-clock numbers from this run are NOT publishable (docs/benchmarking.md); ratios "
        f"are still interleaved, but expect noise. Recorded in the JSON as machine.busy.\n{bar}",
        file=sys.stderr,
    )
    return True


def git_commit() -> str | None:
    """HEAD of the repository holding this package (with '-dirty' when files are modified)."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
        )
        return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None
