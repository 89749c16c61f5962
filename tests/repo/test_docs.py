"""The user guide builds, and every command it shows parses.

`mkdocs build --strict` fails on a broken link, a missing anchor or a page left out of the nav.
Every command in a fenced shell block of the guide or the README (`lightning-spec ...`,
`python experiments/<study>/scripts/X.py ...`, `python -m lightning_spec....`, `./scripts/...`) is
run through its real parser up to the point where work would start: an argparse command's
`parse_args` (an unknown option or a bad value fails), a `fit`/`prepare` config through
LightningCLI's parser (the config file exists and every `--model.init_args.x` override names a
real argument), a script's existence. Nothing is trained or downloaded.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
SHELL = {"", "bash", "sh", "console", "shell"}


class _Parsed(Exception):
    """Raised in place of the work that follows a successful parse."""


def shell_blocks(text: str) -> list[str]:
    """The bodies of the fenced blocks of `text` in a shell language (or none named)."""
    blocks, body, language = [], [], None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            if language is None:
                language, body = stripped[3:].strip().lower(), []
            else:
                if language in SHELL:
                    blocks.append("\n".join(body))
                language = None
        elif language is not None:
            body.append(line)
    return blocks


def shown_commands() -> list[tuple[str, str]]:
    """(page, command line) for every command line in a fenced shell block of the guide."""
    found = []
    for page in PAGES:
        for block in shell_blocks(page.read_text(encoding="utf-8")):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split(" # ")[0].strip()
                if line.startswith(("lightning-spec ", "python ", "./scripts/", ".venv/bin/")):
                    found.append((str(page.relative_to(ROOT)), line))
    return found


COMMANDS = shown_commands()


def test_the_guide_builds_strictly(tmp_path: Path) -> None:
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    assert mkdocs, "mkdocs is a dev dependency (pip install -e '.[dev]')"
    done = subprocess.run(
        [mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_guide_shows_commands_from_every_page_kind() -> None:
    pages = {page for page, _ in COMMANDS}
    assert {"README.md", "docs/training.md", "docs/benchmarking.md"} <= pages
    assert len(COMMANDS) >= 20


def _prose(text: str) -> str:
    """A page without its fenced blocks: the figures a reader is told, not commands shown."""
    kept, fenced = [], False
    for line in text.splitlines():
        if line.strip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            kept.append(line)
    return "\n".join(kept)


# A speedup (1.43x), a signed change (+10.1%, -0.07%) or an interval ([+9.3, +10.8]).
FIGURE = re.compile(
    r"(?<![\w.])\d+\.\d+x\b"
    r"|(?<![\w.])[+-]\d+(?:\.\d+)?%"
    r"|\[[+-]?\d+(?:\.\d+)?%?, [+-]?\d+(?:\.\d+)?%?\]"
)


def test_the_front_page_does_not_copy_the_readme() -> None:
    """docs/index.md points into the guide; the README's tables live in the README only, so the
    two cannot drift apart."""
    readme = {r for r in (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
              if r.startswith("|") and not set(r) <= set("|- ")}  # fmt: skip
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8").splitlines()
    assert not readme & {row.replace("](", "](docs/") for row in index}
    assert not readme & set(index)


def test_every_figure_in_the_readme_and_the_guide_is_on_the_results_page() -> None:
    """RESULTS.md is the one page figures come from: a speedup, a signed change or an interval
    quoted in the README or the guide must stand there too, with its conditions and command."""
    results = (ROOT / "RESULTS.md").read_text(encoding="utf-8")
    missing = []
    for page in PAGES:
        for figure in sorted(set(FIGURE.findall(_prose(page.read_text(encoding="utf-8"))))):
            if figure not in results:
                missing.append(f"{page.relative_to(ROOT)}: {figure}")
    assert not missing, missing


OUTSIDE_NOTES = ("ARCHITECTURE.md", "ALGORITHMS.md", "METHOD-REVIEWS.md", "MEASURING.md",
                 "STACK.md", "ASSETS.md", "STYLE.md", "shared/design")


def test_the_project_points_only_to_its_own_pages() -> None:
    """A newcomer has the repository, not the design notes it grew from: docstrings, configs and
    pages point to `docs/` (`docs/architecture.md`, the method pages, `docs/benchmarking.md`)."""
    found = []
    for folder in ("lightning_spec", "callbacks", "export", "kernels", "configs", "bench",
                   "scripts", "tests", "docs"):  # fmt: skip
        for path in (ROOT / folder).rglob("*"):
            if path.suffix not in {".py", ".md", ".yaml", ".sh"} or path == Path(__file__):
                continue
            text = path.read_text(encoding="utf-8", errors="replace")
            found += [f"{path.relative_to(ROOT)}: {n}" for n in OUTSIDE_NOTES if n in text]
    for page in ("README.md", "RESULTS.md"):
        text = (ROOT / page).read_text(encoding="utf-8")
        found += [f"{page}: {n}" for n in OUTSIDE_NOTES if n in text]
    assert not found, found


def _parse_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make argparse and LightningCLI stop right after a successful parse."""
    real = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):  # noqa: ANN001, ANN202
        real(self, args, namespace)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    from lightning.pytorch.cli import LightningCLI

    def instantiate_then_stop(self) -> None:  # noqa: ANN001
        raise _Parsed

    monkeypatch.setattr(LightningCLI, "instantiate_classes", instantiate_then_stop)


def _run_parser(argv: list[str]) -> None:
    """Run the program `argv` names until its parser has parsed."""
    head = argv[0].removeprefix(".venv/bin/")
    if head == "lightning-spec":
        from lightning_spec.cli import main

        main(argv[1:])
    elif head.startswith("python"):
        if argv[1] == "-m":
            module = importlib.import_module(argv[2])
            module.main(argv[3:])
        elif argv[1] == "-c":  # a one-liner: run it
            done = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True)
            assert done.returncode == 0, done.stderr[-2000:]
            return
        else:
            path = ROOT / argv[1]
            assert path.is_file(), f"{argv[1]} does not exist"
            spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)  # type: ignore[union-attr]
            module.main(argv[2:])
    elif head.startswith("./scripts/"):
        assert (ROOT / head).is_file(), f"{head} does not exist"
        return
    else:
        pytest.fail(f"no parser for {argv[0]!r}")
    pytest.fail("the command ran past its parser")


@pytest.mark.parametrize(("page", "line"), COMMANDS, ids=[f"{p}:{c[:60]}" for p, c in COMMANDS])
def test_every_command_in_the_guide_parses(
    page: str, line: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = shlex.split(line)
    _parse_only(monkeypatch)
    monkeypatch.chdir(ROOT)  # commands are shown from the repository root
    try:
        _run_parser(argv)
    except _Parsed:
        return
    except SystemExit as error:  # argparse's answer to a bad option
        pytest.fail(f"{page}: `{line}` does not parse (exit {error.code})")
