"""Property-based fuzzing of `fit` config values (hypothesis): out-of-range numbers, wrong types
and malformed tree specs fail through the real CLI before any data is prepared, with the field
named, whatever the value drawn."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]

# field override -> (values that must be refused, the words the error must contain)
BAD_VALUES = {
    "model.init_args.ttt_steps": (st.integers(max_value=0), "ttt_steps"),
    "model.init_args.draft_vocab_size": (st.integers(max_value=0), "draft_vocab_size"),
    "model.init_args.ttt_decay": (
        st.floats(max_value=0.0) | st.floats(min_value=1.0001, allow_infinity=False),
        "ttt_decay",
    ),
    "model.init_args.lr": (st.floats(max_value=0.0) | st.just(math.nan), "lr"),
    "model.init_args.warmup_steps": (st.integers(max_value=-1), "warmup_steps"),
    "data.init_args.batch_size": (st.integers(max_value=0), "batch_size"),
    "data.init_args.val_fraction": (
        st.floats(max_value=-1e-9, allow_nan=False, allow_infinity=False)
        | st.floats(min_value=1.0, allow_nan=False, allow_infinity=False),
        "val_fraction",
    ),
    "data.init_args.max_length": (st.integers(max_value=1), "max_length"),
    "model.init_args.ttt_steps ": (
        st.text(st.characters(categories=["L"]), min_size=1),
        "ttt_steps",
    ),
}


def _fails_naming(
    overrides: list[str], field: str, assets: dict[str, str], root: Path, capsys
) -> None:  # noqa: ANN001
    from lightning_spec.cli import lightning_cli

    base = [
        "--config", str(ROOT / "configs" / "train" / "eagle3_quickstart_cpu.yaml"),
        f"--model.init_args.target={assets['model']}",
        f"--model.init_args.draft_vocab_size={assets['vocab']}",
        f"--model.init_args.cache_dir={root / 'cache'}",
        f"--data.init_args.target={assets['model']}",
        f"--data.init_args.dataset={assets['chats']}",
        f"--data.init_args.cache_dir={root / 'data'}",
        f"--trainer.default_root_dir={root / 'run'}",
        f"--trainer.logger.init_args.run_dir={root / 'run'}",
    ]  # fmt: skip
    with pytest.raises((SystemExit, ValueError)) as error:
        lightning_cli([*base, *overrides], run=False)
    message = str(error.value) + capsys.readouterr().err
    assert field in message, message[-2000:]
    assert not (root / "data").exists(), "refused before any data preparation"


@pytest.mark.parametrize("override", sorted(BAD_VALUES), ids=str.strip)
def test_bad_values_fail_naming_the_field(
    override: str, tiny_cli_assets: dict[str, str], tmp_path_factory, capsys
) -> None:  # noqa: ANN001
    strategy, field = BAD_VALUES[override]

    @settings(
        max_examples=3, deadline=None, derandomize=True,
        suppress_health_check=[HealthCheck.function_scoped_fixture],
    )  # fmt: skip
    @given(value=strategy)
    def check(value: object) -> None:
        root = tmp_path_factory.mktemp("fuzz")
        _fails_naming([f"--{override.strip()}={value}"], field, tiny_cli_assets, root, capsys)

    check()


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(spec=st.text(st.sampled_from("chaindymcst:,0123456789-+lookup"), min_size=1, max_size=14))
def test_malformed_tree_specs_are_refused_naming_the_spec(spec: str) -> None:
    """Any string that is not a valid tree spec fails to parse with the spec quoted; a valid
    one parses (so the fuzzing also reaches the accepting side)."""
    from lightning_spec.decoding.build import parse_tree_spec

    try:
        parse_tree_spec(spec)
    except ValueError as error:
        assert repr(spec.strip()) in str(error) or spec.strip() in str(error), str(error)
