"""The promotion rule with hand-made figures: stored figures decide when they are comparable,
otherwise both drafters are re-measured together (an injected `measure`), margin edges, the
first candidate, and the decision logged on the versions and the run."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from lightning_spec.registry import (
    Decision,
    drafter_metadata,
    promote,
    register_drafter,
    registry_client,
)

_names = itertools.count()


class Measure:
    """Returns fixed figures and records what it was asked to measure."""

    def __init__(self, **taus: float) -> None:
        self.taus = taus
        self.calls: list[dict[str, str]] = []

    def __call__(self, drafters: dict[str, Any]) -> dict[str, float]:
        self.calls.append({label: type(d).__name__ for label, d in drafters.items()})
        return dict(self.taus)


def _never(drafters: dict[str, Any]) -> dict[str, float]:
    raise AssertionError("stored figures were comparable: nothing should be measured")


@pytest.fixture
def registry(folders: dict[str, Path], tracking_uri: str):  # noqa: ANN201
    """`add(folder, tau=..., **conditions) -> version` into a fresh model name."""
    name = f"promo-{next(_names)}"

    def add(
        folder: str = "random",
        tau: float | None = None,
        *,
        prompt_set: str = "toy",
        temperature: float = 0.0,
        tree: str | None = "chain:3",
        max_new_tokens: int | None = 16,
        target: str | None = None,
    ) -> str:
        taus = {(prompt_set, temperature): tau} if tau is not None else None
        metadata = drafter_metadata(
            folders[folder],
            taus=taus,
            tree=tree,
            max_new_tokens=max_new_tokens,
            target=target,
            commit="test",
        )
        version = register_drafter(
            folders[folder], name, tracking_uri=tracking_uri, metadata=metadata
        )
        return str(version.version)

    add.name = name
    return add


def _promote(registry, version: str, tracking_uri: str, **kwargs: Any) -> Decision:  # noqa: ANN001
    options = {"prompt_set": "toy", "tree": "chain:3", "max_new_tokens": 16, "measure": _never}
    return promote(registry.name, version, tracking_uri=tracking_uri, **{**options, **kwargs})


def _aliases(tracking_uri: str, name: str) -> dict[str, str]:
    model = registry_client(tracking_uri).get_registered_model(name)
    return {alias: str(version) for alias, version in model.aliases.items()}


def test_first_candidate_becomes_champion(registry, tracking_uri: str) -> None:  # noqa: ANN001
    version = registry("random", 1.4)
    decision = _promote(registry, version, tracking_uri)
    assert decision.outcome == "champion" and decision.promoted
    assert decision.champion_version is None and decision.champion_tau is None
    assert decision.candidate_tau == pytest.approx(1.4)
    assert not decision.remeasured and "no champion yet" in decision.reason
    assert _aliases(tracking_uri, registry.name) == {"champion": version}
    again = _promote(registry, version, tracking_uri)
    assert again.outcome == "champion" and again.reason == "already the champion"


def test_comparable_figures_decide_and_are_logged(registry, tracking_uri: str) -> None:  # noqa: ANN001
    client = registry_client(tracking_uri)
    first = registry("random", 2.0)
    _promote(registry, first, tracking_uri)
    better = registry("self", 2.2)
    decision = _promote(registry, better, tracking_uri, run_id=None)
    assert decision.outcome == "champion" and decision.comparable and not decision.remeasured
    assert (decision.candidate_tau, decision.champion_tau) == pytest.approx((2.2, 2.0))
    assert decision.champion_version == first
    assert _aliases(tracking_uri, registry.name) == {"champion": better}
    assert client.get_model_version(registry.name, first).tags["promotion/replaced_by"] == better

    worse = registry("random2", 2.1)
    run_id = client.get_model_version(registry.name, worse).run_id
    decision = _promote(registry, worse, tracking_uri, run_id=run_id)
    assert decision.outcome == "challenger" and not decision.promoted
    assert "2.100 <= 2.200 + margin 0.05" in decision.reason
    assert _aliases(tracking_uri, registry.name) == {"champion": better, "challenger": worse}
    tags = client.get_model_version(registry.name, worse).tags
    assert tags["promotion/outcome"] == "challenger"
    assert tags["promotion/candidate_tau"] == "2.1" and tags["promotion/champion_tau"] == "2.2"
    assert tags["promotion/champion_version"] == better
    assert tags["promotion/comparable"] == "true" and tags["promotion/remeasured"] == "false"
    run = client.get_run(run_id)
    assert run.data.metrics["promotion/candidate_tau"] == pytest.approx(2.1)
    assert run.data.metrics["promotion/champion_tau"] == pytest.approx(2.2)
    assert run.data.metrics["promotion/promoted"] == 0.0
    assert run.data.params["promotion/outcome"] == "challenger"
    assert run.data.params["promotion/champion_version"] == better

    # The challenger, measured again later with a better figure, takes the champion alias and
    # loses the challenger alias.
    client.set_model_version_tag(registry.name, worse, "tau/toy/T0", "2.5")
    decision = _promote(registry, worse, tracking_uri, run_id=run_id)
    assert decision.promoted
    assert _aliases(tracking_uri, registry.name) == {"champion": worse}
    # A second decision on the same run does not fail on the (immutable) params.
    assert client.get_run(run_id).data.tags["promotion/outcome"] == "champion"


def _reset(tracking_uri: str, name: str, champion: str, candidate: str, **tags: str) -> None:
    """Champion alias back on `champion`, no challenger, candidate tags replaced."""
    client = registry_client(tracking_uri)
    client.set_registered_model_alias(name, "champion", champion)
    if "challenger" in client.get_registered_model(name).aliases:
        client.delete_registered_model_alias(name, "challenger")
    for key, value in tags.items():
        if value is None:
            client.delete_model_version_tag(name, candidate, key)
        else:
            client.set_model_version_tag(name, candidate, key, value)


def test_margin_edges(registry, tracking_uri: str) -> None:  # noqa: ANN001
    champion = registry("random", 2.0)
    _promote(registry, champion, tracking_uri)
    candidate = registry("self", 2.0)
    for tau, margin, outcome in [
        ("2.05", 0.05, "challenger"),  # equal to champion + margin: not enough
        ("2.0501", 0.05, "champion"),
        ("2.0", 0.0, "challenger"),  # a tie never moves the alias
        ("2.0001", 0.0, "champion"),
        ("3.0", 1.0, "challenger"),
        ("3.0001", 1.0, "champion"),
    ]:
        _reset(tracking_uri, registry.name, champion, candidate, **{"tau/toy/T0": tau})
        decision = _promote(registry, candidate, tracking_uri, margin=margin)
        assert decision.outcome == outcome, (tau, margin, decision.reason)
    with pytest.raises(ValueError, match="margin"):
        _promote(registry, candidate, tracking_uri, margin=-0.1)


def test_incomparable_figures_are_remeasured_side_by_side(
    registry,  # noqa: ANN001
    tracking_uri: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    champion = registry("random", 3.0, target="tiny-llama")
    _promote(registry, champion, tracking_uri)
    candidate = registry("self", 1.5)
    baseline = {"tau/toy/T0": "1.5", "tree": "chain:3", "max_new_tokens": "16"}
    baseline["target_model"] = "tiny-llama"
    cases = [
        ({"tree": "chain:2"}, "candidate measured with tree 'chain:2'"),
        ({"tree": None}, "candidate measured with tree None"),
        ({"tau/toy/T0": None, "tau/toy/T0.7": "1.5"}, "candidate no tau/toy/T0 figure"),
        ({"tau/toy/T0": None, "tau/other/T0": "1.5"}, "candidate no tau/toy/T0 figure"),
        ({"max_new_tokens": "32"}, "candidate measured with 32 new tokens"),
        ({"target_model": "another-target"}, "different targets"),
    ]
    for change, why in cases:
        _reset(tracking_uri, registry.name, champion, candidate, **{**baseline, **change})
        measure = Measure(candidate=1.5, champion=1.2)
        caplog.clear()
        with caplog.at_level("INFO", logger="lightning_spec.registry.promotion"):
            decision = _promote(registry, candidate, tracking_uri, measure=measure)
        assert measure.calls == [{"candidate": "StandaloneDrafter", "champion": "Eagle3Drafter"}]
        assert why in caplog.text, (why, caplog.text)
        assert not decision.comparable and decision.remeasured
        # The stored 3.0 is ignored: the side-by-side figures decide.
        assert (decision.candidate_tau, decision.champion_tau) == (1.5, 1.2)
        assert decision.outcome == "champion" and "re-measured side by side" in decision.reason
    # With every condition equal the stored figures decide (1.5 against 3.0), nothing measured.
    _reset(tracking_uri, registry.name, champion, candidate, **baseline)
    decision = _promote(registry, candidate, tracking_uri)
    assert decision.comparable and decision.outcome == "challenger"


def test_missing_figures_are_remeasured_and_kept(registry, tracking_uri: str) -> None:  # noqa: ANN001
    client = registry_client(tracking_uri)
    unmeasured = registry("random", None, tree=None, max_new_tokens=None)
    assert _promote(registry, unmeasured, tracking_uri).promoted  # nothing to beat
    candidate = registry("self", 2.0)
    measure = Measure(candidate=2.0, champion=2.5)
    decision = _promote(registry, candidate, tracking_uri, measure=measure)
    assert len(measure.calls) == 1 and decision.outcome == "challenger"
    tags = client.get_model_version(registry.name, unmeasured).tags
    assert (tags["tau/toy/T0"], tags["tree"], tags["max_new_tokens"]) == ("2.5", "chain:3", "16")
    # Both figures are now stored for these conditions: the next decision measures nothing.
    decision = _promote(registry, candidate, tracking_uri)
    assert decision.comparable and decision.outcome == "challenger"


def test_remeasuring_needs_a_measure_or_a_target(registry, tracking_uri: str) -> None:  # noqa: ANN001
    _promote(registry, registry("random", 2.0, tree="chain:2"), tracking_uri)
    candidate = registry("self", 2.0)
    with pytest.raises(ValueError, match="re-measured"):
        _promote(registry, candidate, tracking_uri, measure=None)
    with pytest.raises(ValueError, match="no tau"):
        _promote(registry, candidate, tracking_uri, measure=Measure(candidate=2.0))


def test_only_absence_counts_as_no_champion(registry, tracking_uri: str) -> None:  # noqa: ANN001
    """A missing model or alias is "no champion"; any other registry error is raised, so a
    transient failure never promotes a candidate unchecked."""
    from mlflow.exceptions import MlflowException

    from lightning_spec.registry.promotion import alias_version

    client = registry_client(tracking_uri)
    assert alias_version(client, "no-such-model", "champion") is None
    version = registry("random", 1.4)
    assert alias_version(client, registry.name, "champion") is None  # model, but no alias yet
    _promote(registry, version, tracking_uri)
    assert str(alias_version(client, registry.name, "champion").version) == version

    class Flaky:  # what a locked SQLite store or a dropped connection raises
        def get_model_version_by_alias(self, name: str, alias: str) -> None:
            raise MlflowException("(sqlite3.OperationalError) database is locked")

    with pytest.raises(MlflowException, match="locked"):
        alias_version(Flaky(), registry.name, "champion")
