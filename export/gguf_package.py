"""`lightning-spec export --format gguf`: the files a llama.cpp deployment needs, in one folder.

``OUTPUT/drafter-<f32|f16>.gguf`` is the EAGLE-3 drafter (`lightning_spec.export.gguf`) or a
DFlash drafter in the engines' layout (llama.cpp's own converter, `lightning_spec.tools.llamacpp`), and
with ``--with-target TYPE`` ``OUTPUT/target-<TYPE>.gguf`` is the target beside it. The target's
tokenizer, which the drafter's file must carry, comes from (in this order) ``--target-gguf``,
the embedded default's own GGUF (SmolLM2's Q4_1 file, the one our de-quantized target was made
from), or a GGUF that llama.cpp's converter makes from the target's model folder. A
``manifest.json`` names every file with its sha256 and the command lines that run it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from lightning_spec.export.gguf import GgufExportError, write_eagle3_gguf
from lightning_spec.io import atomic_write_json, sha256_file
from lightning_spec.models.drafters.base import drafter_type_of

__all__ = ["export_gguf_package"]


def _embedded_default(target: str | None) -> bool:
    """Whether `target` names the embedded default (by name or by its cached folder)."""
    if target is None:
        return False
    if target in {"smollm2", "default"}:
        return True
    from lightning_spec.data.assets import AssetError, default_target_path

    try:
        cached = default_target_path(fetch_if_missing=False)
    except AssetError:  # not cached: then the target is not that folder
        return False
    return Path(target).expanduser().resolve() == cached.resolve()


def _target_of(drafter: Path, target: str | None) -> str | None:
    if target is not None:
        return target
    config = json.loads((drafter / "config.json").read_text())
    return config.get("target_model")


def _model_folder(target: str) -> Path:
    if _embedded_default(target):
        from lightning_spec.data.assets import default_target_path

        return default_target_path()
    folder = Path(target).expanduser()
    if not (folder / "config.json").is_file():
        raise GgufExportError(
            f"target {target!r} is not a model folder here: give its GGUF with --target-gguf"
        )
    return folder


def _target_file(target: str, outtype: str, output: Path) -> Path:
    """The target's GGUF of `outtype` at `output` (the embedded Q4_1 file is copied as is)."""
    from lightning_spec.tools.llamacpp import convert_target

    if outtype == "q4_1" and _embedded_default(target):
        from lightning_spec.data.assets import fetch

        shutil.copyfile(fetch("smollm2"), output)
        return output
    return convert_target(_model_folder(target), output, outtype)


def export_gguf_package(
    drafter: str | Path,
    output: str | Path,
    *,
    target: str | None = None,
    target_gguf: str | Path | None = None,
    with_target: str | None = None,
    outtype: str = "f32",
    reuse_target: bool = False,
) -> dict[str, Any]:
    """Write the drafter GGUF (and the target's, when `with_target` names a type) into
    `output`; return the manifest (also written as ``manifest.json``). `reuse_target` keeps a
    target file already there (a bench exporting into its cache folder again)."""
    drafter, output = Path(drafter), Path(output)
    if not (drafter / "config.json").is_file():
        raise GgufExportError(f"{drafter} is not a drafter folder (config.json is missing)")
    output.mkdir(parents=True, exist_ok=True)
    target = _target_of(drafter, target)
    files: dict[str, Path] = {}
    if with_target is not None:
        if target is None:
            raise GgufExportError("--with-target needs --target (the drafter names none)")
        path = output / f"target-{with_target}.gguf"
        files["target"] = path if reuse_target and path.is_file() else _target_file(target, with_target, path)
    if target_gguf is not None:
        source = Path(target_gguf)
    elif "target" in files:
        source = files["target"]
    elif target is not None and _embedded_default(target):
        from lightning_spec.data.assets import fetch

        source = fetch("smollm2")
    elif target is not None:
        source = _target_file(target, "f16", output / "target-f16.gguf")
        files["target"] = source
    else:
        raise GgufExportError("the drafter names no target: give --target or --target-gguf")
    config = json.loads((drafter / "config.json").read_text())
    block = drafter_type_of(config) == "dflash"
    if block:  # llama.cpp's own converter reads our DFlash layout (tools/llamacpp.py)
        from lightning_spec.tools.llamacpp import convert_dflash

        if target is None:
            raise GgufExportError("a DFlash export needs --target (the model folder)")
        files["drafter"] = convert_dflash(
            drafter, _model_folder(target), output / f"drafter-{outtype}.gguf", outtype
        )
    else:
        files["drafter"] = write_eagle3_gguf(
            drafter, source, output / f"drafter-{outtype}.gguf", outtype=outtype
        )
    manifest: dict[str, Any] = {
        "format": "gguf",
        "drafter_folder": str(drafter.resolve()),
        "target": target,
        "tokenizer_from": str(source),
        "files": {k: {"path": p.name, "sha256": sha256_file(p)} for k, p in files.items()},
    }
    if "target" in files:
        t, d = files["target"].name, files["drafter"].name
        spec, n_max = ("draft-dflash", int(config["block_size"]) - 1) if block else ("draft-eagle3", 4)
        manifest["run"] = {
            "llama-server": f"llama-server -m {t} --model-draft {d} --spec-type {spec} "
            f"--spec-draft-n-max {n_max} -t 2",
            "llama-speculative-simple": f"llama-speculative-simple -m {t} --model-draft {d} "
            f"--spec-type {spec} --spec-draft-n-max {n_max} -p PROMPT -n 64 --temp 0",
        }
    atomic_write_json(output / "manifest.json", manifest)
    return manifest
