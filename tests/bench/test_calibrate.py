"""calibrate: the speedup model on hand-made numbers, policy choice, measurements on tiny models."""

from __future__ import annotations

import json

import pytest

from lightning_spec import specs
from lightning_spec.bench import calibrate
from lightning_spec.bench.calibrate import AcceptanceProfile
from lightning_spec.cli import calibrate as calibrate_cli
from lightning_spec.decoding.build import DynamicTreePolicy
from lightning_spec.models.drafters.standalone import StandaloneDrafter
from lightning_spec.models.target import TargetModel
from lightning_spec.models.tiny import tiny_config


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return TargetModel.from_config(tiny_config("llama", num_layers=2), seed=11)


# ------------------------------------------------------------------------------ the model
def test_chain_expected_tokens() -> None:
    # 1 + 0.8 + 0.8*0.5 + 0.8*0.5*0.25 = 1 + 0.8 + 0.4 + 0.1
    assert calibrate.expected_tokens_per_step("chain:3", [0.8, 0.5, 0.25]) == pytest.approx(2.3)
    # a deeper chain than measured reuses the last alpha: + 0.1 * 0.25
    assert calibrate.expected_tokens_per_step("chain:4", [0.8, 0.5, 0.25]) == pytest.approx(2.325)


def test_expected_speedup_on_hand_made_numbers() -> None:
    curve = {1: 0.050, 4: 0.080, 8: 0.100}
    # chain:3 verifies 3 drafts + the root = 4 tokens: 0.080 s; drafting 3 levels * 5 ms;
    # overhead 1 ms -> 0.096 s per step = 1.92 autoregressive steps; 2.3 tokens per step
    speedup = calibrate.expected_speedup("chain:3", [0.8, 0.5, 0.25], curve, 0.005, overhead=0.001)
    assert speedup == pytest.approx(2.3 / (0.096 / 0.050))
    # a measured plain autoregressive step (40 ms) is the unit when given
    measured = calibrate.expected_speedup(
        "chain:3", [0.8, 0.5, 0.25], curve, 0.005, overhead=0.001, autoregressive_seconds=0.040
    )
    assert measured == pytest.approx(2.3 / (0.096 / 0.040))
    # per-depth draft costs: 2 + 3 + 4 ms
    seconds = calibrate.step_seconds("chain:3", curve, [0.002, 0.003, 0.004])
    assert seconds == pytest.approx(0.080 + 0.009)


def test_tree_uses_rank_acceptance() -> None:
    profile = AcceptanceProfile(rank_acceptance=[[0.6, 0.2], [0.5, 0.1]], at_risk=[10, 6])
    shape = [(0,), (1,), (0, 0), (0, 1)]
    # 1 + p(1,0) + p(1,1) + p(1,0) p(2,0) + p(1,0) p(2,1) = 1 + 0.6 + 0.2 + 0.3 + 0.06
    assert calibrate.expected_tokens_per_step(shape, profile) == pytest.approx(2.16)
    # with per-depth alpha only, side branches earn nothing (best-path approximation)
    assert calibrate.expected_tokens_per_step(shape, [0.6, 0.5]) == pytest.approx(1.9)
    # a static policy is modelled by its own rank paths
    static = calibrate.rank_paths("static:tiny", profile)
    assert len(static) == 6 and (0,) in static


def test_dynamic_shape_is_a_tree_of_the_right_size() -> None:
    profile = AcceptanceProfile(
        rank_acceptance=[[0.5, 0.2, 0.1], [0.6, 0.2, 0.1], [0.7, 0.1, 0.05]], at_risk=[1, 1, 1]
    )
    paths = calibrate.rank_paths(DynamicTreePolicy(3, 3, 9), profile)
    assert len(paths) == 8
    assert set(paths) >= {(0,), (1,), (0, 0)}
    assert all(path[:i] in paths for path in paths for i in range(1, len(path)))
    assert max(len(p) for p in paths) <= 3 and max(max(p) for p in paths) < 3


def test_interpolated_cost_is_linear_and_monotone() -> None:
    curve = {1: 0.05, 4: 0.08, 8: 0.12}
    assert calibrate.interpolate_cost(curve, 6) == pytest.approx(0.10)
    assert calibrate.interpolate_cost(curve, 16) == pytest.approx(0.20)  # extrapolated
    noisy = {1: 0.05, 4: 0.09, 8: 0.07}  # a lucky large size must not look cheaper
    assert calibrate.interpolate_cost(noisy, 8) == pytest.approx(0.09)


def test_shrinkage_toward_the_parent_depth() -> None:
    # depth 2 reached once and hit once; depth 3 never reached
    table = calibrate.shrink_toward_parent([[5, 1], [1, 0], [0, 0]], [10, 1, 0], 5.0)
    assert table[0] == pytest.approx([0.5, 0.1])
    assert table[1] == pytest.approx([(1 + 5 * 0.5) / 6, (0 + 5 * 0.1) / 6])
    assert table[2] == pytest.approx(table[1])


@pytest.mark.parametrize(
    ("curve", "winner"),
    [
        ({1: 0.05, 64: 0.05}, "chain:8"),  # flat (GPU-like): verifying more is free
        ({1: 0.05, 2: 0.10, 64: 3.2}, "chain:1"),  # steep: every token costs a full step
    ],
)
def test_suggest_policy_picks_the_obvious_winner(curve: dict[int, float], winner: str) -> None:
    alpha = [0.9] * 8
    spec, speedup, table = calibrate.suggest_policy(
        alpha, curve, 0.0005, candidates=["chain:1", "chain:4", "chain:8"]
    )
    assert spec == winner
    assert table[0]["policy"] == winner and speedup == table[0]["expected_speedup"]
    assert [row["expected_speedup"] for row in table] == sorted(
        (row["expected_speedup"] for row in table), reverse=True
    )


def test_default_candidates_follow_the_cost_curve() -> None:
    profile = AcceptanceProfile(rank_acceptance=[[0.7, 0.15, 0.05]] * 8, at_risk=[100] * 8)
    flat, _, _ = calibrate.suggest_policy(profile, {1: 0.05, 64: 0.05}, 0.0005)
    steep, _, _ = calibrate.suggest_policy(profile, {1: 0.05, 2: 0.1, 64: 3.2}, 0.0005)
    assert calibrate.rank_paths(flat, profile).__len__() >= 16  # a big tree when it is free
    assert steep == "chain:1"


# ------------------------------------------------------------------------------ measurements
def test_measure_verify_cost_on_a_tiny_target(target: TargetModel) -> None:
    curve = calibrate.measure_verify_cost(target, (1, 4), context=16, repeats=2, warmup=1)
    assert sorted(curve) == [1, 4]
    assert all(seconds > 0 for seconds in curve.values())


def test_measure_acceptance_of_self_drafting(target: TargetModel) -> None:
    drafter = StandaloneDrafter.from_model(target.model)
    prompts = [list(range(3, 12)), list(range(20, 31))]
    profile = calibrate.measure_acceptance(
        target, drafter, prompts, depth=4, ranks=3, max_new_tokens=21, stop_on_eos=False
    )
    # the target agrees with itself: rank 0 at every depth, every step reaches every depth
    assert profile.alpha == pytest.approx([1.0] * 4)
    assert all(row[1:] == [0.0, 0.0] for row in profile.rank_acceptance)
    assert profile.at_risk == [profile.steps] * 4
    assert profile.tau == pytest.approx(20 * 2 / profile.steps)  # 20 verified tokens a prompt
    assert profile.draft_seconds_per_depth > 0 and profile.verify_seconds > 0
    restored = AcceptanceProfile.from_dict(json.loads(json.dumps(profile.to_dict())))
    assert restored.alpha == profile.alpha


def test_block_drafters_are_calibrated_within_their_block(target: TargetModel) -> None:
    """A DFlash block of 4 drafts 3 tokens in one forward: only trees of depth <= 3 are
    candidates, and drafting is charged once per step whatever the depth."""
    from lightning_spec.decoding.build import parse_tree_spec
    from lightning_spec.models.drafters.dflash import DFlashDrafter

    drafter = DFlashDrafter.from_target(target, block_size=4)
    result = calibrate.calibrate(
        target, drafter, [list(range(3, 12))], sizes=(1, 4, 8), context=16, repeats=1,
        max_new_tokens=12,
    )  # fmt: skip
    assert result["block_slots"] == 3 and result["acceptance"]["probe"] == "chain:3"
    assert all(parse_tree_spec(row["policy"]).max_depth <= 3 for row in result["table"])
    first, *rest = result["draft_cost"]
    assert first > 0 and rest == [0.0, 0.0]
    again, _, _ = calibrate.suggestion_from_calibration(result)
    assert again == result["suggestion"]["policy"]


def test_calibrate_cli_wiring(
    target: TargetModel, monkeypatch: pytest.MonkeyPatch, tmp_path, capsys
) -> None:
    prompts = [(list(range(3, 12)), {"id": "a", "category": None})]
    monkeypatch.setattr(specs, "resolve_target", lambda spec, dtype: target)
    monkeypatch.setattr(specs, "load_prompts", lambda spec, tok, limit: ("toy", prompts))
    output = tmp_path / "calibration.json"
    code = calibrate_cli.main(
        [
            "--drafter", "self", "--sizes", "1,2,4", "--context", "16", "--repeats", "1",
            "--depth", "3", "--max-new-tokens", "10", "--threads", "1", "--output", str(output),
            "--candidate", "chain:1", "--candidate", "chain:3", "--candidate", "dynamic:2,2,4",
        ]
    )  # fmt: skip
    assert code == 0
    result = json.loads(output.read_text())
    assert set(result["cost_curve"]) == {"1", "2", "4"}
    assert result["suggestion"]["policy"] in {"chain:1", "chain:3", "dynamic:2,2,4"}
    assert len(result["table"]) == 3
    assert result["config"]["machine"]["cores"] >= 1
    assert output.with_suffix(".md").read_text().startswith("Verification cost")
    assert "Suggested tree" in capsys.readouterr().out
    # bench --tree auto can reuse this file
    spec, _, _ = calibrate.suggestion_from_calibration(result)
    assert spec == result["suggestion"]["policy"]


def test_calibrate_cli_cost_curve_only(
    target: TargetModel, monkeypatch: pytest.MonkeyPatch, tmp_path, capsys
) -> None:
    monkeypatch.setattr(specs, "resolve_target", lambda spec, dtype: target)
    output = tmp_path / "cost.json"
    code = calibrate_cli.main(
        ["--sizes", "1,3", "--context", "8", "--repeats", "1", "--threads", "1",
         "--output", str(output)]
    )  # fmt: skip
    assert code == 0
    result = json.loads(output.read_text())
    assert set(result["cost_curve"]) == {"1", "3"} and result["autoregressive_step_seconds"] > 0
    assert "| N | 1 | 3 |" in output.with_suffix(".md").read_text()
    assert "One plain autoregressive step" in capsys.readouterr().out
