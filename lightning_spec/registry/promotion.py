"""Promotion: the `champion` alias moves only to a drafter measured to be better.

Rule (docs/registry.md): a candidate version takes the `champion` alias when its tau beats the
champion's by more than `margin` (tau_candidate > tau_champion + margin) on the same prompt
set, temperature and tree policy (and, when both record it, the same max new tokens and target).
Figures come from the versions' tags (`tau/<prompt set>/T<temperature>` with the `tree` tag).
When either version lacks a figure for exactly those conditions, both drafters are re-measured
side by side in one interleaved `run_bench` call (the `measure` callable), so the comparison
never mixes two runs. Otherwise the candidate gets the `challenger` alias. The first version of
a model becomes champion. The decision and both figures are written as version tags and, when a
run is known, as that run's metrics and params (`promotion/*`).

Two promotions of one model at the same time (a sweep finishing together) cannot both win:
the alias is moved under a lock (`promotion_lock`: a file lock per tracking URI and model in the
asset cache), and only if the champion is still the one the decision was made against; when
another promotion moved it meanwhile, the decision is made again against the new champion
(compare-and-set). The lock serialises promotions on one machine; processes on several machines
sharing one server still re-check the champion right before moving it, which narrows the race
to the moment between that read and the alias call but cannot close it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from lightning_spec.registry.metadata import tau_key
from lightning_spec.registry.register import (
    CHALLENGER,
    CHAMPION,
    load_registered_drafter,
    registry_client,
    resolve_tracking_uri,
)

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_MARGIN",
    "Decision",
    "Measure",
    "alias_version",
    "bench_measure",
    "promote",
    "promotion_lock",
    "stored_tau",
]

DEFAULT_MARGIN = 0.05
Measure = Callable[[dict[str, Any]], Mapping[str, float]]
"""`{"candidate": Drafter, "champion": Drafter}` -> `{"candidate": tau, "champion": tau}`,
measured together (interleaved) on the promotion's prompt set, temperature and tree."""


@dataclass
class Decision:
    """What `promote` decided, with the figures it decided on."""

    model_name: str
    candidate_version: str
    champion_version: str | None
    candidate_tau: float | None
    champion_tau: float | None
    margin: float
    comparable: bool
    """True when both versions' stored figures were for the promotion's conditions."""
    remeasured: bool
    """True when both drafters were measured again, side by side, for this decision."""
    outcome: str
    """`champion` (the candidate holds the champion alias) or `challenger`."""
    reason: str
    prompt_set: str = ""
    temperature: float = 0.0
    tree: str = ""

    @property
    def promoted(self) -> bool:
        return self.outcome == CHAMPION

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        def tau(value: float | None) -> str:
            return "-" if value is None else f"{value:.3f}"

        champion = self.champion_version or "none"
        return (
            f"{self.model_name} version {self.candidate_version} -> {self.outcome}: candidate "
            f"tau {tau(self.candidate_tau)}, champion (version {champion}) tau "
            f"{tau(self.champion_tau)}, margin {self.margin:g} on {self.prompt_set} "
            f"T={self.temperature:g} {self.tree} ({self.reason})"
        )


# ---------------------------------------------------------------------------------- figures
def _finite(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def stored_tau(
    tags: Mapping[str, str], key: str, tree: str, max_new_tokens: int | None = None
) -> tuple[float | None, str]:
    """(tau, "") when `tags` hold a figure for `key` under `tree` (and `max_new_tokens`, when
    both sides know it); else (None, why not)."""
    if tags.get("tree") != tree:
        return None, f"measured with tree {tags.get('tree')!r}, not {tree!r}"
    value = _finite(tags.get(key))
    if value is None:
        return None, f"no {key} figure"
    recorded = tags.get("max_new_tokens")
    if max_new_tokens is not None and recorded is not None and recorded != str(max_new_tokens):
        return None, f"measured with {recorded} new tokens, not {max_new_tokens}"
    return value, ""


def _means_absent(error: Any) -> bool:
    """Whether an MLflow error says the model or alias does not exist (and nothing else)."""
    code = getattr(error, "error_code", "")
    message = str(error)
    if code == "RESOURCE_DOES_NOT_EXIST":
        return True
    return code == "INVALID_PARAMETER_VALUE" and "not found" in message


def alias_version(client: Any, model_name: str, alias: str) -> Any | None:
    """The ModelVersion holding `alias`, or None when the model or the alias does not exist.

    Any other error (a server that is down, a locked store, a timeout) is raised: counting a
    transient failure as "no champion" would promote the candidate unchecked."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(model_name, alias)
    except MlflowException as error:
        if _means_absent(error):
            return None
        raise


def bench_measure(
    target: Any,
    prompts: Sequence[Any],
    *,
    prompt_set: str,
    tree: str,
    temperature: float = 0.0,
    max_new_tokens: int = 64,
    seed: int = 0,
) -> Measure:
    """A `Measure` running both drafters in one interleaved `run_bench` call on `prompts`
    (token-id lists or `(ids, meta)` pairs, as `specs.load_prompts` returns them)."""
    from lightning_spec.bench.runner import run_bench

    items = [
        p if isinstance(p, tuple) else (list(map(int, p)), {"id": f"p{i}"})
        for i, p in enumerate(prompts)
    ]

    def measure(drafters: dict[str, Any]) -> dict[str, float]:
        result = run_bench(
            target,
            {label: d.to(target.device).to(target.dtype) for label, d in drafters.items()},
            tree,
            {prompt_set: items},
            methods=("speculative",),
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed,
            warmup=0,
            bootstrap_resamples=200,
        )
        return taus_from_bench(result, prompt_set)

    return measure


def taus_from_bench(result: Mapping[str, Any], dataset: str) -> dict[str, float]:
    """Overall tau per drafter label from `run_bench` rows (`speculative` for a single one)."""
    taus: dict[str, float] = {}
    for row in result["rows"]:
        method = row["method"]
        if row["category"] is None and row["dataset"] == dataset and method.startswith("spec"):
            label = method.split(":", 1)[1] if ":" in method else method
            if row.get("mismatches"):
                log.warning("%s: %d greedy mismatch(es) while measuring", label, row["mismatches"])
            if row.get("tau") is not None:
                taus[label] = float(row["tau"])
    return taus


# ---------------------------------------------------------------------------------- promote
def promote(
    model_name: str,
    candidate_version: str | int,
    *,
    prompt_set: str,
    temperature: float = 0.0,
    tree: str = "chain:4",
    margin: float = DEFAULT_MARGIN,
    max_new_tokens: int | None = None,
    tracking_uri: str | None = None,
    run_id: str | None = None,
    measure: Measure | None = None,
    target: Any = None,
    prompts: Sequence[Any] | None = None,
) -> Decision:
    """Apply the promotion rule (module docstring) to `candidate_version` of `model_name`.

    Re-measuring uses `measure`, else `bench_measure(target, prompts, ...)`; with neither a
    ValueError says so. `run_id` receives the decision as metrics and params.
    """
    if margin < 0:
        raise ValueError(f"margin must be >= 0, got {margin}")
    uri = resolve_tracking_uri(tracking_uri)
    client = registry_client(uri)
    for _ in range(MAX_DECISIONS):
        champion = alias_version(client, model_name, CHAMPION)
        decision = _decide(
            client, model_name, candidate_version, champion, prompt_set=prompt_set,
            temperature=temperature, tree=tree, margin=margin, max_new_tokens=max_new_tokens,
            measure=measure, target=target, prompts=prompts, uri=uri,
        )  # fmt: skip
        with promotion_lock(uri, model_name):
            now = alias_version(client, model_name, CHAMPION)
            if _version_of(now) == _version_of(champion):
                _apply(client, decision)
                break
        log.info(
            "promotion of %s v%s: the champion moved from v%s to v%s while deciding; "
            "deciding again against the new champion",
            model_name, candidate_version, _version_of(champion), _version_of(now),
        )  # fmt: skip
    else:
        raise RuntimeError(
            f"promotion of {model_name} v{candidate_version}: the champion kept moving during "
            f"{MAX_DECISIONS} decisions; try again"
        )
    _log_decision(client, decision, run_id)
    log.info("promotion: %s", decision.summary())
    return decision


MAX_DECISIONS = 5


def _version_of(version: Any) -> str | None:
    return None if version is None else str(version.version)


def promotion_lock(uri: str, model_name: str) -> Any:
    """The inter-process lock promotions of `model_name` at `uri` move aliases under."""
    import hashlib

    from lightning_spec.data.assets import cache_root
    from lightning_spec.io import file_lock

    digest = hashlib.sha256(f"{uri}|{model_name}".encode()).hexdigest()[:16]
    return file_lock(cache_root() / "locks" / f"promotion-{digest}.lock")


def _decide(
    client: Any,
    model_name: str,
    candidate_version: str | int,
    champion: Any,
    *,
    prompt_set: str,
    temperature: float,
    tree: str,
    margin: float,
    max_new_tokens: int | None,
    measure: Measure | None,
    target: Any,
    prompts: Sequence[Any] | None,
    uri: str,
) -> Decision:
    """The promotion rule for `candidate_version` against `champion` (None: no champion)."""
    key = tau_key(prompt_set, temperature)
    candidate = client.get_model_version(model_name, str(candidate_version))
    common = {
        "model_name": model_name,
        "candidate_version": str(candidate.version),
        "margin": float(margin),
        "prompt_set": prompt_set,
        "temperature": float(temperature),
        "tree": tree,
    }
    candidate_tau, candidate_why = stored_tau(candidate.tags, key, tree, max_new_tokens)
    if champion is None or str(champion.version) == str(candidate.version):
        first = champion is None
        decision = Decision(
            **common,
            champion_version=None if first else str(champion.version),
            candidate_tau=candidate_tau,
            champion_tau=None if first else candidate_tau,
            comparable=False,
            remeasured=False,
            outcome=CHAMPION,
            reason="no champion yet: the first candidate becomes champion"
            if first
            else "already the champion",
        )
    else:
        champion_tau, champion_why = stored_tau(champion.tags, key, tree, max_new_tokens)
        targets = {v.tags.get("target_model") for v in (candidate, champion)} - {None}
        comparable = candidate_tau is not None and champion_tau is not None and len(targets) < 2
        remeasured = not comparable
        if remeasured:
            why = "; ".join(
                w
                for w in (
                    candidate_why and f"candidate {candidate_why}",
                    champion_why and f"champion {champion_why}",
                    len(targets) > 1 and f"different targets {sorted(targets)}",
                )
                if w
            )
            log.info(
                "re-measuring versions %s and %s (%s)", candidate.version, champion.version, why
            )
            figures = _remeasure(
                client,
                model_name,
                candidate.version,
                champion.version,
                measure
                or _default_measure(target, prompts, prompt_set, tree, temperature, max_new_tokens),
                target,
                uri,
            )
            candidate_tau, champion_tau = figures["candidate"], figures["champion"]
            for version, tau in ((candidate, candidate_tau), (champion, champion_tau)):
                _record_figure(client, model_name, version, key, tau, tree, max_new_tokens)
        better = candidate_tau - champion_tau > margin + 1e-9
        stored = "re-measured side by side" if remeasured else "stored figures"
        decision = Decision(
            **common,
            champion_version=str(champion.version),
            candidate_tau=candidate_tau,
            champion_tau=champion_tau,
            comparable=comparable,
            remeasured=remeasured,
            outcome=CHAMPION if better else CHALLENGER,
            reason=(
                f"{stored}: {candidate_tau:.3f} {'>' if better else '<='} "
                f"{champion_tau:.3f} + margin {margin:g}"
            ),
        )
    return decision


def _default_measure(
    target: Any,
    prompts: Sequence[Any] | None,
    prompt_set: str,
    tree: str,
    temperature: float,
    max_new_tokens: int | None,
) -> Measure:
    if target is None or not prompts:
        raise ValueError(
            "the stored tau figures are not comparable, so both drafters must be re-measured: "
            "pass measure=, or target= and prompts="
        )
    return bench_measure(
        target,
        prompts,
        prompt_set=prompt_set,
        tree=tree,
        temperature=temperature,
        max_new_tokens=max_new_tokens or 64,
    )


def _remeasure(
    client: Any,
    model_name: str,
    candidate_version: str,
    champion_version: str,
    measure: Measure,
    target: Any,
    uri: str,
) -> dict[str, float]:
    device = getattr(target, "device", "cpu")
    drafters = {
        label: load_registered_drafter(model_name, version=version, tracking_uri=uri, device=device)
        for label, version in (("candidate", candidate_version), ("champion", champion_version))
    }
    figures = {label: _finite(tau) for label, tau in dict(measure(drafters)).items()}
    missing = [label for label in drafters if figures.get(label) is None]
    if missing:
        raise ValueError(f"the measurement returned no tau for {missing}: got {figures}")
    return {label: float(figures[label]) for label in drafters}


def _record_figure(
    client: Any,
    model_name: str,
    version: Any,
    key: str,
    tau: float,
    tree: str,
    max_new_tokens: int | None,
) -> None:
    """Keep a re-measured figure on a version whose tags describe the same conditions."""
    tags = version.tags
    if tags.get("tree") not in (None, tree) or key in tags:
        return
    recorded = tags.get("max_new_tokens")
    if recorded is not None and max_new_tokens is not None and recorded != str(max_new_tokens):
        return
    updates = {key: f"{tau:.6g}", "tree": tree}
    if max_new_tokens is not None:
        updates["max_new_tokens"] = str(max_new_tokens)
    for name, value in updates.items():
        client.set_model_version_tag(model_name, str(version.version), name, value)


def _apply(client: Any, decision: Decision) -> None:
    name, version = decision.model_name, decision.candidate_version
    if decision.promoted:
        client.set_registered_model_alias(name, CHAMPION, version)
        challenger = alias_version(client, name, CHALLENGER)
        if challenger is not None and str(challenger.version) == version:
            client.delete_registered_model_alias(name, CHALLENGER)
        if decision.champion_version and decision.champion_version != version:
            client.set_model_version_tag(
                name, decision.champion_version, "promotion/replaced_by", version
            )
    else:
        client.set_registered_model_alias(name, CHALLENGER, version)


def _log_decision(client: Any, decision: Decision, run_id: str | None) -> None:
    from mlflow.exceptions import MlflowException

    values = {
        "outcome": decision.outcome,
        "candidate_version": decision.candidate_version,
        "champion_version": decision.champion_version or "none",
        "candidate_tau": "none"
        if decision.candidate_tau is None
        else f"{decision.candidate_tau:.6g}",
        "champion_tau": "none" if decision.champion_tau is None else f"{decision.champion_tau:.6g}",
        "margin": f"{decision.margin:g}",
        "comparable": str(decision.comparable).lower(),
        "remeasured": str(decision.remeasured).lower(),
        "prompt_set": decision.prompt_set,
        "temperature": f"{decision.temperature:g}",
        "tree": decision.tree,
        "reason": decision.reason,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    for key, value in values.items():
        client.set_model_version_tag(
            decision.model_name, decision.candidate_version, f"promotion/{key}", value
        )
    if run_id is None:
        return
    for key in ("candidate_tau", "champion_tau"):
        value = getattr(decision, key)
        if value is not None:
            client.log_metric(run_id, f"promotion/{key}", value)
    client.log_metric(run_id, "promotion/promoted", 1.0 if decision.promoted else 0.0)
    for key in ("outcome", "candidate_version", "champion_version", "margin", "remeasured"):
        try:
            client.log_param(run_id, f"promotion/{key}", values[key])
        except MlflowException:  # a param logged before with another value: keep both visible
            client.set_tag(run_id, f"promotion/{key}", values[key])
    client.set_tag(run_id, "promotion/reason", decision.reason)
