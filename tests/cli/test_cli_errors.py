"""From the shell, an error that describes the user's input is one message, not a traceback
through our internals: tried as a new user would, with a drafter trained for another target."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_spec.cli import TRACEBACK_ENV, is_user_error, main
from lightning_spec.models.drafters.eagle3 import Eagle3Drafter


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    code = "import sys; from lightning_spec.cli import main; sys.exit(main())"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})  # fmt: skip


def test_a_drafter_of_another_target_is_one_clear_message(
    tiny_cli_assets: dict[str, str], data_helpers, tmp_path: Path
) -> None:
    tokenizer = data_helpers.make_chat_tokenizer()
    other = data_helpers.make_tiny_target(tokenizer, seed=7)  # same shapes, other weights
    Eagle3Drafter.from_target(other).save_pretrained(tmp_path / "drafter")
    args = ("generate", "--target", tiny_cli_assets["model"], "--drafter",
            str(tmp_path / "drafter"), "--prompt", "hello", "--max-new-tokens", "4")  # fmt: skip
    shown = _cli(*args)
    assert shown.returncode == 1
    assert "lightning-spec generate: error: this drafter was trained for another target" in (
        shown.stderr
    )
    assert "weights: trained for" in shown.stderr and "Traceback" not in shown.stderr
    traced = _cli(*args, env={TRACEBACK_ENV: "1"})
    assert traced.returncode == 1 and "Traceback" in traced.stderr


def test_called_from_python_errors_still_raise(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        main(["generate", "--target", str(tmp_path / "missing"), "--prompt", "x"])
    assert is_user_error(ValueError("bad")) and not is_user_error(KeyError("bug"))
