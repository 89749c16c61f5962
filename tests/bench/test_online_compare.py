"""lightning-spec bench online (lightning_spec/bench/online_compare.py): the comparison table and
figure from hand-made stream logs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compare():  # noqa: ANN201
    from lightning_spec.bench import online_compare

    return online_compare


def _write(folder: Path, taus: list[float], update: float) -> None:
    """Live logs: every request 10 tokens in 0.5 s (20 tok/s), `update` seconds per round."""
    folder.mkdir(parents=True)
    requests = [{"round": i // 2, "request": i, "tau": t, "tokens": 10, "seconds": 0.5,
                 "tokens_per_s": 20.0} for i, t in enumerate(taus)]  # fmt: skip
    rounds = [
        {"round": r, "requests": 2, "tau": sum(taus[2 * r : 2 * r + 2]) / 2, "tokens_per_s": 20.0,
         "net_tokens_per_s": 20.0 / (1.0 + update), "update_seconds": update,
         "prequential_tokens_per_s": 20.0, "rolled_back": float(r == 1)}
        for r in range(len(taus) // 2)
    ]  # fmt: skip
    (folder / "requests.jsonl").write_text("".join(json.dumps(x) + "\n" for x in requests))
    (folder / "rounds.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rounds))


def test_table_pairs_every_request_with_frozen_and_draws_the_figure(
    compare, tmp_path: Path
) -> None:
    _write(tmp_path / "frozen", [2.0, 2.0, 2.0, 2.0], 0.0)
    _write(tmp_path / "ogd", [2.0, 2.2, 2.4, 2.6], 1.0 / 3.0)
    table = compare.summarize(tmp_path, ["frozen", "ogd"])
    assert table["frozen"]["prequential_tau"] == pytest.approx(2.0)
    assert table["ogd"]["prequential_tau"] == pytest.approx(2.3)
    assert table["ogd"]["paired_gain"] == pytest.approx(0.3)
    low, high = table["ogd"]["paired_gain_ci"]
    assert 0.0 <= low <= 0.3 <= high
    assert table["ogd"]["relative_gain"] == pytest.approx(0.15)
    low, high = table["ogd"]["relative_gain_ci"]
    assert 0.0 <= low <= 0.15 <= high
    assert table["ogd"]["tau@?"] == pytest.approx(2.3)
    assert table["ogd"]["net_tokens_per_s"] == pytest.approx(15.0)  # 40 tokens in 2 s + 2/3 s
    assert table["ogd"]["tokens_per_s"] == pytest.approx(20.0)
    assert table["frozen"]["net_tokens_per_s"] == table["frozen"]["tokens_per_s"] == pytest.approx(20.0)
    assert table["ogd"]["rolled_back"] == 1.0
    # both served live: the measured tokens/s gains, paired over requests (same seconds per
    # request; the update's 1/3 s a round charged as 1/6 s to each of its 2 requests)
    assert table["ogd"]["served_gain"] == pytest.approx(0.0)
    assert table["ogd"]["net_gain"] == pytest.approx(15.0 / 20.0 - 1)
    low, high = table["ogd"]["net_gain_ci"]
    assert low == pytest.approx(-0.25) and high == pytest.approx(-0.25)
    assert "served_gain" not in table["frozen"]
    assert compare.plot(tmp_path, ["frozen", "ogd"]).stat().st_size > 1000
    assert compare._options("dpo", {"lr": 1.0, "learners": 3, "beta": 0.2}) == {
        "lr": 1.0,
        "beta": 0.2,
    }


def test_a_mixed_stream_gets_each_domains_paired_gain(compare, tmp_path: Path) -> None:
    """A broad stream (chat then code): the whole-stream gain can come from one segment alone."""
    _write(tmp_path / "frozen", [2.0, 2.0, 2.0, 2.0], 0.0)
    _write(tmp_path / "ogd", [2.0, 2.0, 2.4, 2.6], 0.0)
    for arm in ("frozen", "ogd"):
        path = tmp_path / arm / "requests.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        for row in rows:
            row["domain"] = "chat" if row["request"] < 2 else "code"
        path.write_text("".join(json.dumps(x) + "\n" for x in rows))
    ogd = compare.summarize(tmp_path, ["frozen", "ogd"])["ogd"]
    assert ogd["gain@chat"] == pytest.approx(0.0)
    assert tuple(ogd["gain@chat_ci"]) == (pytest.approx(0.0), pytest.approx(0.0))
    assert ogd["gain@code"] == pytest.approx(0.25)
    low, high = ogd["gain@code_ci"]
    assert 0.2 - 1e-9 <= low <= 0.25 <= high <= 0.3 + 1e-9
    one_domain = tmp_path / "one"
    _write(one_domain / "frozen", [2.0, 2.0], 0.0)
    _write(one_domain / "ogd", [2.0, 2.2], 0.0)
    assert not any(k.startswith("gain@") for k in compare.summarize(one_domain, ["frozen", "ogd"])["ogd"])


def test_the_hindsight_ceiling_is_read_on_its_own_tail_requests(compare, tmp_path: Path) -> None:
    _write(tmp_path / "frozen", [2.0, 2.0, 2.0, 2.0], 0.0)
    _write(tmp_path / "ogd", [2.0, 2.2, 2.4, 2.6], 1.0 / 3.0)
    folder = tmp_path / "hindsight"
    folder.mkdir()
    rows = [{"round": 0, "request": 2, "tau": 3.0}, {"round": 0, "request": 3, "tau": 3.0}]
    (folder / "requests.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    (folder / "rounds.jsonl").write_text(json.dumps(
        {"round": 0, "requests": 2, "tau": 3.0, "tokens_per_s": 0.0, "net_tokens_per_s": 0.0,
         "prequential_tokens_per_s": 0.0}) + "\n")  # fmt: skip
    table = compare.summarize(tmp_path, ["frozen", "ogd", "hindsight"])
    assert table["ogd"]["tau@hindsight_tail"] == pytest.approx(2.5)
    assert table["frozen"]["tau@hindsight_tail"] == pytest.approx(2.0)
    assert table["hindsight"]["ceiling_share"] == pytest.approx(1.0)
    assert table["ogd"]["ceiling_share"] == pytest.approx(0.5)  # (2.5 - 2) / (3 - 2)
    assert table["hindsight"]["paired_gain"] == pytest.approx(1.0)
    # in the figure the ceiling's one round sits above the stream's second round (request 2)
    assert compare._round_starts(folder, compare._rows(folder / "rounds.jsonl")) == [2]
    assert compare._round_starts(tmp_path / "ogd", compare._rows(tmp_path / "ogd" / "rounds.jsonl")) == [0, 2]
    assert compare._options("hindsight", {"lr": 1.0, "epochs": 2}) == {"lr": 1.0, "epochs": 2}
    assert compare._options("ogd", {"lr": 1.0, "epochs": 2, "beta": 0.1}) == {"lr": 1.0, "epochs": 2}


def test_set_overrides_split_config_keys_from_strategy_options(compare) -> None:
    parsed = compare.parse_overrides(
        ["optimistic.lr=5e-1", "optimistic.drafter=runs/hydra/best", "ogd.steps_per_round=4"],
        ["frozen", "ogd", "optimistic"],
    )
    assert parsed["optimistic"] == ({"drafter": "runs/hydra/best"}, {"lr": 0.5})
    assert parsed["ogd"] == ({}, {"steps_per_round": 4})
    with pytest.raises(ValueError, match="NAME.KEY=VALUE"):
        compare.parse_overrides(["ogd-lr=1"], ["ogd"])
    with pytest.raises(ValueError, match="not among"):
        compare.parse_overrides(["dpo.beta=0.2"], ["ogd"])
    with pytest.raises(ValueError, match="fixed"):
        compare.parse_overrides(["ogd.out_dir=x"], ["ogd"])


def test_figure_mode_draws_runs_of_several_comparisons_without_serving(
    compare, tmp_path: Path
) -> None:
    _write(tmp_path / "a" / "frozen", [2.0, 2.0, 2.0, 2.0], 0.0)
    _write(tmp_path / "b" / "optimistic", [2.0, 2.2, 2.4, 2.6], 1.0 / 3.0)
    png = tmp_path / "figures" / "tau.png"
    code = compare.main(["--out", str(png), "--figure", f"eagle3 frozen={tmp_path / 'a' / 'frozen'}",
                         "--figure", f"hydra optimistic={tmp_path / 'b' / 'optimistic'}"])  # fmt: skip
    assert code == 0 and png.stat().st_size > 1000
    with pytest.raises(ValueError, match="no rounds.jsonl"):
        compare.parse_figure_runs([f"x={tmp_path}"])
    with pytest.raises(ValueError, match="LABEL=FOLDER"):
        compare.parse_figure_runs([str(tmp_path)])
    with pytest.raises(SystemExit):  # neither a config to serve nor runs to draw
        compare.main(["--out", str(tmp_path / "c")])


def test_replayed_runs_are_priced_at_a_live_runs_step_cost(compare, tmp_path: Path) -> None:
    live = tmp_path / "live"
    live.mkdir()
    rows = [{"round": 0, "request": i, "tau": 2.0, "tokens": 10, "verifications": 5,
             "seconds": 1.0, "replayed": False} for i in range(2)]  # fmt: skip
    (live / "requests.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    step = compare.live_step_seconds(live)
    assert step == pytest.approx(0.2)  # 2 s over 10 steps
    replayed = [{"round": 0, "request": i, "tau": 2.5, "tokens": 10, "verifications": 4,
                 "seconds": 0.1, "replayed": True} for i in range(2)]  # fmt: skip
    estimate = compare._live_estimate(replayed, [{"update_seconds": 0.4}], step)
    assert estimate["est_live_tokens_per_s"] == pytest.approx(20 / 1.6)
    assert estimate["est_live_net_tokens_per_s"] == pytest.approx(20 / 2.0)
    assert estimate["update_share_of_serving"] == pytest.approx(0.25)
    # paired over requests: frozen (5 steps each, no update) against the run above (4 steps
    # each and a 0.4 s update spread over its round's 2 requests)
    frozen = compare._estimate_columns(rows, [{"round": 0, "requests": 2}], step)
    mine = compare._estimate_columns(replayed, [{"round": 0, "requests": 2, "update_seconds": 0.4}], step)
    assert mine == {0: (10, pytest.approx(1.0)), 1: (10, pytest.approx(1.0))}
    net = compare._net_gain(mine, frozen)
    assert net["est_live_net_gain"] == pytest.approx((20 / 2.0) / (20 / 2.0) - 1)
    low, high = net["est_live_net_gain_ci"]
    assert low == pytest.approx(0.0) and high == pytest.approx(0.0)  # identical requests
    assert compare._net_gain(mine, {}) == {}
    with pytest.raises(ValueError, match="no live"):
        folder = tmp_path / "only_replayed"
        folder.mkdir()
        (folder / "requests.jsonl").write_text("".join(json.dumps(x) + "\n" for x in replayed))
        compare.live_step_seconds(folder)


def test_runs_stopped_at_different_rounds_compare_on_the_same_first_requests(
    compare, tmp_path: Path
) -> None:
    _write(tmp_path / "frozen", [2.0, 2.0, 2.0, 2.0, 2.0, 2.0], 0.0)
    _write(tmp_path / "ogd", [2.0, 2.4, 3.0, 3.0], 1.0)  # stopped after 2 rounds
    requests = compare._rows(tmp_path / "ogd" / "requests.jsonl")
    rounds = compare._rows(tmp_path / "ogd" / "rounds.jsonl")
    kept, cut = compare.first_requests(list(reversed(requests)), rounds, 3)
    assert [r["request"] for r in kept] == [0, 1, 2]  # stream order, not log order
    kept_rounds = [(r["round"], r["requests"], r["update_seconds"]) for r in cut]
    assert kept_rounds == [(0, 2, 1.0), (1, 1, 0.5)]  # the cut round keeps half its update
    table = compare.summarize(tmp_path, ["frozen", "ogd"], first=3)
    assert table["frozen"]["requests"] == table["ogd"]["requests"] == 3
    assert table["ogd"]["prequential_tau"] == pytest.approx(7.4 / 3)
    assert table["ogd"]["net_tokens_per_s"] == pytest.approx(30 / (1.5 + 1.5))  # 1 + 0.5 s charged
    assert compare.main(["--out", str(tmp_path), "--strategies", "frozen,ogd", "--table-only",
                         "--first-requests", "3"]) == 0  # fmt: skip
    assert json.loads((tmp_path / "summary_first3.json").read_text())["ogd"]["requests"] == 3


def test_killing_the_wrapper_takes_its_strategy_child_down(tmp_path: Path) -> None:
    """SIGTERM to online_compare must not orphan the `lightning-spec online` it started."""
    import os
    import signal
    import subprocess
    import sys
    import time

    pid_file = tmp_path / "child.pid"
    child = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    wrapper = (
        "import sys\n"
        "from lightning_spec.bench import online_compare as module\n"
        f"sys.exit(module.run_child([sys.executable, '-c', {child!r}]))\n"
    )
    process = subprocess.Popen([sys.executable, "-c", wrapper], cwd=ROOT)
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text()):
        assert time.monotonic() < deadline and process.poll() is None, "the child never started"
        time.sleep(0.05)
    child_pid = int(pid_file.read_text())
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 128 + signal.SIGTERM
    deadline = time.monotonic() + 30
    while True:
        try:
            os.kill(child_pid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, f"child {child_pid} outlived the wrapper"
        time.sleep(0.05)
