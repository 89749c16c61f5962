"""The probes' tests share the fixtures of tests/conftest.py, and load a probe by its name.

A conftest.py applies to its own folder and below, so the fixtures of tests/conftest.py (the
tiny target and chats, the thread pinning, Triton's interpreter on CPU) are taken from it here
for every study's tests. The probes are scripts, run as files, not a package: `study_script`
loads ``experiments/<study>/scripts/<name>.py`` as a module (probe names are unique across
studies).
"""

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

EXPERIMENTS = Path(__file__).resolve().parent


def _tests_conftest() -> ModuleType:
    """tests/conftest.py as pytest imports it (``tests.conftest``, with --import-mode=importlib),
    the same module object whichever folder is collected first."""
    name = "tests.conftest"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXPERIMENTS.parent / "tests" / "conftest.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


_shared = _tests_conftest()
# fixtures, found by pytest under these names in this conftest
_test_threads = _shared._test_threads
data_helpers = _shared.data_helpers
greedy_fit = _shared.greedy_fit
tiny_cli_assets = _shared.tiny_cli_assets
load_module = _shared.load_module


def probe_path(name: str) -> Path:
    """``experiments/<study>/scripts/<name>.py`` for the one study that holds it."""
    found = sorted(EXPERIMENTS.glob(f"*/scripts/{name}.py"))
    if len(found) != 1:
        raise FileNotFoundError(f"{len(found)} probes named {name}.py under {EXPERIMENTS}")
    return found[0]


@pytest.fixture(scope="session")
def study_script() -> Callable[[str], ModuleType]:
    """A probe script of any study as a module, by its name."""
    return lambda name: load_module(probe_path(name), f"probe_{name}")
