"""Every module imports, every subpackage is packaged, and the mapped packages install."""

from __future__ import annotations

import importlib
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

import lightning_spec

ROOT = Path(__file__).resolve().parents[2]


def _modules() -> list[str]:
    names = []
    for info in pkgutil.walk_packages(lightning_spec.__path__, "lightning_spec."):
        names.append(info.name)
    for mapped in ("callbacks", "export", "kernels"):
        package = importlib.import_module(f"lightning_spec.{mapped}")
        names.append(package.__name__)
        for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            names.append(info.name)
    return sorted(set(names))


@pytest.mark.parametrize("name", _modules())
def test_module_imports(name: str) -> None:
    importlib.import_module(name)


def test_every_subpackage_is_listed_in_pyproject() -> None:
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {"lightning_spec"}
    for folder in [ROOT / "lightning_spec"]:
        for init in folder.rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT)
            found.add(".".join(relative.parts))
    for mapped in ("callbacks", "export", "kernels"):
        for init in (ROOT / mapped).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / mapped)
            found.add(".".join(("lightning_spec", mapped, *relative.parts)).rstrip("."))
    assert found <= listed, f"add to pyproject [tool.setuptools] packages: {sorted(found - listed)}"


def test_cli_help_is_fast_and_lists_commands() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "lightning_spec.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0
    for command in ("fit", "assets", "bench", "export", "generate"):
        assert command in result.stdout
    # No heavy library may be imported just to print help.
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, lightning_spec.cli as c; c.main(['--help']);"
            "print(sorted(m for m in ('mlflow','onnx','triton','transformers','lightning') if m in sys.modules))",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.stdout.strip().endswith("[]"), probe.stdout


def test_unknown_command_fails_clearly() -> None:
    from lightning_spec.cli import main

    assert main(["frobnicate"]) == 2


def test_regular_install_maps_packages(tmp_path: Path) -> None:
    """`pip install .` (not editable) puts callbacks/export/kernels under lightning_spec only."""
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(ROOT),
        ],
        check=True,
        timeout=300,
    )
    assert not (target / "callbacks").exists() and not (target / "kernels").exists()
    code = "import lightning_spec.callbacks, lightning_spec.export, lightning_spec.kernels, lightning_spec; print(lightning_spec.__file__)"
    env = {**os.environ, "PYTHONPATH": str(target)}
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith(str(target))


def test_the_top_level_kernels_name_goes_to_an_installed_kernels_package(tmp_path: Path) -> None:
    """From the repository root, `import kernels` must not hand transformers our Triton folder
    when Hugging Face's kernels package is installed (transformers >= 5.25 imports it)."""
    other = tmp_path / "site" / "kernels"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("CUDAProperties = 'installed'\n")
    code = "import kernels; print(getattr(kernels, 'CUDAProperties', 'ours'))"
    installed = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path.insert(1, {str(tmp_path / 'site')!r}); {code}"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert installed.stdout.strip() == "installed", installed.stderr
