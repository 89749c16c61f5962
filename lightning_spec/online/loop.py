"""The OnlineSpec loop: serve a round, read the verification feedback, update, repeat.

Each round serves `round_size` requests of the stream with the strategy's current drafter
(lossless speculative decoding through the one engine, `SpeculativeDecoder`, keeping the
target features it computed anyway), records per request tau, tokens/s and wall time, then lets
the strategy update from the round (`online.strategies`). Test first, train second: a round is
always served by the model that existed before it, so the per-request figures are prequential.

An optional `SafetyGuard` measures tau on a few held-out prompts before and after each update
and rolls back an update that lowers it by more than a margin (logged as ``rolled_back``).

The update's time is charged to throughput (`net_tokens_per_s`: served tokens over serving plus
update time), the honest figure when updates run in the serving process; with `update_beside`
they run in a worker thread while the next round is served (`online.beside`) and only the
server's wait for them is charged.

After every round an atomic checkpoint (`round.pt`: the round index, the strategy's state,
the random state) and the request log (`requests.jsonl`, one line per served request, appended
and fsynced) are written; a killed stream started again with the same folder resumes at the
first round not checkpointed, and requests logged by that unfinished round are served again
(their lines are dropped on resume, so no request is counted twice).
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_spec.decoding.build import TreePolicy
from lightning_spec.decoding.engine import SpeculativeDecoder
from lightning_spec.decoding.lookup import require_drafter_policy
from lightning_spec.io import atomic_path
from lightning_spec.online.strategies import OnlineStrategy
from lightning_spec.online.stream import Request

log = logging.getLogger(__name__)

__all__ = [
    "SafetyGuard",
    "guarded_update",
    "replay_captured",
    "replay_request",
    "load_feedback",
    "matches_greedy",
    "prequential_summary",
    "run_stream",
    "save_feedback",
    "served_totals",
]

CHECKPOINT = "round.pt"
REQUESTS = "requests.jsonl"
ROUNDS = "rounds.jsonl"


def _read_lines(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a torn last line from a kill
            break
    return out


def _write_lines(path: Path, rows: list[dict[str, Any]]) -> None:
    from lightning_spec.io import atomic_write_text

    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))


def _append(path: Path, row: dict[str, Any]) -> None:
    with path.open("a") as handle:
        handle.write(json.dumps(row) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


@dataclass
class SafetyGuard:
    """Roll back an update that costs acceptance: tau of the served drafter on a few held-out
    `prompts` is measured before and after each update; a drop by more than `margin` (relative)
    restores the strategy's state from before the update. Its decoding time is charged to the
    update (it is part of what updating costs)."""

    prompts: list[list[int]]
    margin: float = 0.05
    max_new_tokens: int = 32

    def tau(self, target: Any, drafter: Any, policy: TreePolicy) -> float:
        decoder = SpeculativeDecoder(target, drafter, policy)
        results = [decoder.generate(p, self.max_new_tokens) for p in self.prompts]
        verifications = sum(r.num_verifications for r in results)
        committed = sum(sum(len(s.committed) for s in r.records) for r in results)
        return committed / verifications if verifications else float("nan")


def guarded_update(
    target: Any,
    strategy: OnlineStrategy,
    policy: TreePolicy,
    generations: list[Any],
    guard: SafetyGuard | None,
) -> dict[str, Any]:
    """The strategy's update from `generations`, rolled back when `guard`'s probe says it cost
    acceptance (see `SafetyGuard`)."""
    if guard is None or strategy.name == "frozen":  # nothing to roll back: no probe to pay for
        return strategy.update(generations)
    tic = time.perf_counter()
    before = guard.tau(target, strategy.drafter, policy)
    saved = copy.deepcopy(strategy.state_dict())
    update = strategy.update(generations)
    after = guard.tau(target, strategy.drafter, policy)
    rolled_back = math.isfinite(before) and after < before * (1 - guard.margin)
    if rolled_back:
        strategy.load_state_dict(saved)
        log.warning("update rolled back: probe tau %.3f -> %.3f (margin %.0f%%)",
                    before, after, 100 * guard.margin)  # fmt: skip
    update = dict(update)
    update.update(probe_tau_before=before, probe_tau_after=after,
                  rolled_back=float(rolled_back),
                  update_seconds=time.perf_counter() - tic)  # fmt: skip
    return update


def run_stream(
    target: Any,
    strategy: OnlineStrategy,
    policy: TreePolicy,
    requests: Sequence[Request],
    *,
    out_dir: str | Path,
    round_size: int = 25,
    max_new_tokens: int = 64,
    logger: Any = None,
    guard: SafetyGuard | None = None,
    regret_window: int = 0,
    record_feedback: bool = False,
    continuations: Sequence[Sequence[int]] | None = None,
    update_every: int = 1,
    replay: bool = True,
    update_beside: bool = False,
    engine: Any = None,
) -> list[dict[str, Any]]:
    """Serve `requests` in rounds with `strategy` (see the module docstring); returns the
    request log. `logger` (optional) gets ``log_metrics(dict, step)`` per round; `guard`
    (optional) rolls back updates that lower a held-out probe's tau (`SafetyGuard`);
    `regret_window` > 0 logs `regret_proxy` every that many rounds (see `regret_proxy`);
    `record_feedback` saves each round's served generations (tokens, step records, kept
    features) to ``feedback/round-NNNN.pt``, so strategies and learning rates can be compared
    offline on the very same feedback (`experiments/onlinespec/scripts/online_replay.py`) without serving again.
    `continuations` (one per request, `online.continuations`): serve by exact greedy replay
    of these known answers instead of decoding (T = 0; tau and feedback as live, time not:
    the rows say ``replayed``); an empty one is decoded live. `update_every` k > 1: the
    strategy learns once every k rounds, from those k rounds together (an update schedule that
    charges serving less often; the rounds in between are served by the same drafter).
    `replay` False with `continuations`: decode live and check each output against its known
    greedy answer instead (rows get ``greedy_match``, rounds ``greedy_mismatches``): the live
    confirmation of a replayed comparison, and a losslessness check on every request.
    `update_beside`: each update runs in a worker thread while the next round is served
    (`online.beside`); ``update_seconds`` is then only what the server waited for it.
    `engine` (an `online.engines.ServingEngine`, e.g. vLLM): the engine serves each round with the
    drafter it holds; the learner rebuilds the feedback by replaying each reply
    (`replay_request`, its seconds charged to the update) and after each update pushes the new
    drafter into the running engine (`online.engines.publish`, charged too). Rows then carry
    the engine's tau (``tau``) beside our replay's (``replay_tau``): equal at T = 0 when the
    engine drafts as our decoder does."""
    if update_every < 1:
        raise ValueError(f"update_every must be >= 1, got {update_every}")
    if update_beside and (guard is not None or regret_window > 0):
        raise ValueError("update_beside runs updates while serving: it cannot be combined with "
                         "a safety guard or a regret window, which read the drafter in between")  # fmt: skip
    if engine is not None and (update_beside or (continuations is not None and replay)):
        raise ValueError("an engine serves every request live: it cannot be combined with "
                         "update_beside or with replayed continuations")  # fmt: skip
    require_drafter_policy(policy, "the OnlineSpec stream (it learns from the rejected drafts)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    start_round = 0
    pending: list[Any] = []  # served generations not learned from yet (update_every > 1)
    launch_pending = False  # update_beside: the checkpoint was taken just before a launch
    checkpoint = out / CHECKPOINT
    # the drafter the engine serves (it starts with the strategy's first one): a failed push
    # leaves the previous one serving, and the feedback must be replayed with that one
    served = copy.deepcopy(strategy.drafter) if engine is not None else None
    if checkpoint.is_file():
        state = torch.load(checkpoint, map_location="cpu", weights_only=False)
        strategy.load_state_dict(state["strategy"])
        start_round = int(state["round"]) + 1
        pending = list(state.get("pending", []))
        launch_pending = bool(state.get("launch_pending", False))
        log.info("resuming the stream at round %d from %s", start_round, checkpoint)
    total_rounds = math.ceil(len(requests) / round_size)
    beside = None
    if update_beside:
        from lightning_spec.online.beside import BesideUpdater

        beside = BesideUpdater(strategy)
        if launch_pending and start_round < total_rounds:
            beside.launch(pending)  # the update the killed run had started
            pending = []
    if engine is not None and start_round > 0 and strategy.name != "frozen":
        _publish(engine, strategy, out, served)  # a new engine serves the resumed drafter
    logged = [r for r in _read_lines(out / REQUESTS) if r["round"] < start_round]
    _write_lines(out / REQUESTS, logged)  # drop what an unfinished round logged
    rounds = [r for r in _read_lines(out / ROUNDS) if r["round"] < start_round]
    _write_lines(out / ROUNDS, rounds)
    window: list[tuple[dict[str, torch.Tensor], list[Any]]] = []
    try:
        for index in range(start_round, total_rounds):
            chunk = requests[index * round_size : (index + 1) * round_size]
            labels = strategy.label_top_k  # soft labels: kept as served
            known = None if continuations is None else continuations[index * round_size :]
            this_round = _Round(index, chunk, max_new_tokens, labels, known)
            if engine is not None:
                generations, rows, feedback_seconds = _engine_round(
                    engine, target, served, policy, this_round
                )
            else:
                drafter = strategy.drafter if beside is None else beside.served
                generations, rows = _serve_round(target, drafter, policy, this_round, replay)
            for row in rows:
                logged.append(row)
                _append(out / REQUESTS, row)
            if record_feedback:
                save_feedback(out, index, generations)
            if regret_window > 0:
                window.append((_served_weights(strategy), generations))
            pending += generations
            due = (index + 1) % update_every == 0 or index == total_rounds - 1
            if due and beside is not None:
                # the previous update (learned while this round was served) is served from now on;
                # this round's is launched once the checkpoint below is written
                waited, previous = beside.settle()
                update = {"online_loss": float("nan"), "update_seconds": waited,
                          **{f"beside_{k}": v for k, v in previous.items()}}  # fmt: skip
            elif due:
                update = guarded_update(target, strategy, policy, pending, guard)
                pending = []
                if engine is not None and strategy.name != "frozen":
                    update = {**update, **_publish(engine, strategy, out, served)}
                    update["update_seconds"] += update["push_seconds"]
            else:
                update = {"online_loss": float("nan"), "update_seconds": 0.0, "labels": 0.0,
                          "skipped_update": 1.0}  # fmt: skip
            if engine is not None:
                update = {**update, "feedback_seconds": feedback_seconds}
                if strategy.name != "frozen":  # rebuilding the feedback is the learner's cost
                    update["update_seconds"] += feedback_seconds
                else:  # no learner reads it: only the check that our replay equals the engine
                    update["diagnostic_seconds"] = update.get("diagnostic_seconds", 0.0) + feedback_seconds
            summary = {"round": index, "strategy": strategy.name,
                       **_round_figures(generations, logged[-len(chunk) :], update),
                       **prequential_summary(logged)}  # fmt: skip
            if engine is not None:
                summary["replay_tau"], summary["tau"] = summary["tau"], _rows_tau(logged[-len(chunk) :])
            launch = due and beside is not None and index < total_rounds - 1
            with atomic_path(checkpoint) as tmp:  # the strategy is idle here, also beside serving
                torch.save({"round": index, "strategy": strategy.state_dict(), "pending": pending,
                            "launch_pending": launch}, tmp)  # fmt: skip
            if launch:
                beside.launch(pending)
                pending = []
            if regret_window > 0 and len(window) == regret_window:
                summary["regret_proxy"] = regret_proxy(strategy, window)
                window.clear()
            rounds.append(summary)
            _write_lines(out / ROUNDS, rounds)
            if logger is not None:
                logger.log_metrics({f"online/{k}": float(v) for k, v in summary.items()
                                    if isinstance(v, (int, float))}, index)  # fmt: skip
            log.info(
                "round %d/%d (%s): tau %.2f, prequential tau %.2f, %.1f tok/s, update %.1f s",
                index + 1, total_rounds, strategy.name, summary["tau"],
                summary["prequential_tau"], summary["tokens_per_s"], update["update_seconds"],
            )  # fmt: skip
    except BaseException:
        if beside is not None:
            beside.abandon()
        raise
    if beside is not None:
        beside.close()
    return logged


FEEDBACK = "feedback"


def replay_request(
    target: Any,
    drafter: Any,
    policy: TreePolicy,
    prompt: Sequence[int],
    answer: Sequence[int],
    *,
    keep_labels: int = 0,
) -> Any:
    """What serving `prompt` with `drafter` gives at T = 0 when its greedy `answer` is known:
    the replayed records plus the committed tokens' target features (as ``keep_features``
    decoding keeps them) and, with `keep_labels`, their soft labels, from one teacher-forced
    pass."""
    from lightning_spec.decoding.replay import replay_greedy, text_pass

    ids = torch.tensor([list(prompt) + list(answer)], device=target.device)
    text = text_pass(target, ids, len(prompt), features=True)
    generation = replay_greedy(
        target, drafter, policy, prompt, answer, text=text, keep_labels=keep_labels
    )
    generation.features = text.features[0, : ids.shape[1] - 1]
    return generation


def replay_captured(
    target: Any, drafter: Any, policy: TreePolicy, captured: Any, *, keep_labels: int = 0
) -> Any:
    """`replay_request` for a request whose target rows the serving engine kept
    (`online.capture.CapturedRequest`): the same generation, features and labels, with no
    target forward (the rows' logits come from ``lm_head`` inside the replay's greedy check).
    The text is the tokens the engine computed: the last committed token, whose row the engine
    never computed, is left out."""
    from lightning_spec.decoding.replay import replay_greedy

    text = captured.text_pass()
    tokens = captured.computed
    generation = replay_greedy(
        target, drafter, policy, tokens[: captured.prompt_len], tokens[captured.prompt_len :],
        text=text, keep_labels=keep_labels,
    )  # fmt: skip
    generation.features = text.features[0, : len(tokens) - 1]
    return generation


def save_feedback(out: Path, index: int, generations: list[Any]) -> Path:
    """Write one round's generations atomically to ``out/feedback/round-NNNN.pt``."""
    path = out / FEEDBACK / f"round-{index:04d}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        torch.save(generations, tmp)
    return path


def load_feedback(folder: str | Path) -> list[list[Any]]:
    """Every recorded round of a stream folder (or its ``feedback/`` folder), in round order;
    an error that says so when none was recorded."""
    root = Path(folder)
    if (root / FEEDBACK).is_dir():
        root = root / FEEDBACK
    paths = sorted(root.glob("round-*.pt"))
    if not paths:
        raise FileNotFoundError(
            f"no recorded rounds in {root}: serve the stream with `record_feedback: true`"
        )
    return [torch.load(path, map_location="cpu", weights_only=False) for path in paths]


def _served_weights(strategy: OnlineStrategy) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in strategy.drafter.state_dict().items()}


def regret_proxy(strategy: OnlineStrategy, window: list[tuple[dict, list[Any]]]) -> float:
    """Dynamic-regret proxy over a window of rounds: the summed online loss of the models that
    served each round, minus that of the best single one of them in hindsight (each served
    model evaluated on every round of the window). 0 for a frozen drafter; negative when the
    updates tracked the stream better than any one model could."""
    from lightning_spec.online.losses import feedback_batch, online_loss

    drafter = copy.deepcopy(strategy.drafter).eval()
    batches = [feedback_batch(generations) for _, generations in window]
    table = []
    with torch.no_grad():
        for weights, _ in window:
            drafter.load_state_dict(weights)
            table.append([float(online_loss(drafter, b)[0]) if b is not None else 0.0
                          for b in batches])  # fmt: skip
    served = sum(table[t][t] for t in range(len(window)))
    best = min(sum(row) for row in table)
    return served - best


SERVED_DRAFTER = "served-drafter"


def _publish(engine: Any, strategy: OnlineStrategy, out: Path, served: Any) -> dict[str, Any]:
    """Push the strategy's drafter into `engine`; on success `served` (our copy of what the
    engine serves) takes its weights, on failure it keeps the previous ones, as the engine does."""
    from lightning_spec.online.engines import publish

    result = publish(engine, strategy.drafter, out / SERVED_DRAFTER)
    if result.get("push_failed"):
        log.warning("the engine kept its previous drafter: %s", result.get("push_error"))
    else:
        served.load_state_dict(strategy.drafter.state_dict())
    return {k: v for k, v in result.items() if k != "push_error"}


@dataclass(frozen=True)
class _Round:
    """One round's requests and what serving them needs, whichever server serves them:
    `known` holds the requests' greedy answers when the stream has them (else None)."""

    index: int
    requests: Sequence[Request]
    max_new_tokens: int
    labels: int  # soft labels kept per position (the strategy's label_top_k)
    known: Sequence[Sequence[int]] | None


def _serve_round(
    target: Any, drafter: Any, policy: TreePolicy, this: _Round, replay: bool
) -> tuple[list[Any], list[dict[str, Any]]]:
    """A round served by our own decoder: each request decoded live, or replayed exactly from
    its known greedy answer (T = 0) when `replay`; the generations and the request rows."""
    labels = this.labels
    decoder = SpeculativeDecoder(target, drafter, policy, keep_features=True, keep_labels=labels)
    generations, rows = [], []
    for offset, request in enumerate(this.requests):
        greedy = None if this.known is None else this.known[offset]
        if greedy and replay:
            result = replay_request(target, drafter, policy, request.prompt, greedy, keep_labels=labels)
        else:
            result = decoder.generate(request.prompt, this.max_new_tokens)
        generations.append(result)
        rows.append(_request_row(this.index, request, result, greedy, replayed=bool(greedy and replay)))
    return generations, rows


def _engine_round(
    engine: Any, target: Any, drafter: Any, policy: TreePolicy, this: _Round
) -> tuple[list[Any], list[dict[str, Any]], float]:
    """A round served by `engine`: the feedback rebuilt by replaying each reply with the drafter
    the engine was given, the request rows (the engine's tau and decode seconds), and the
    seconds the replays took."""
    from lightning_spec.online.engines import engine_tau

    served = engine.serve([r.prompt for r in this.requests], this.max_new_tokens)
    tic = time.perf_counter()
    generations = engine_feedback(target, drafter, policy, this.requests, served, this.labels)
    rows = []
    replies = zip(this.requests, served, generations, strict=True)
    for offset, (request, item, result) in enumerate(replies):
        known = None if this.known is None else this.known[offset]
        row = _request_row(this.index, request, result, known, replayed=False)
        tau, steps = engine_tau([item])
        row.update(replay_tau=row["tau"], tau=tau, verifications=steps, engine=engine.name,
                   engine_drafter=engine.served[:12])  # fmt: skip
        rows.append(row)
    return generations, rows, time.perf_counter() - tic


def engine_feedback(
    target: Any,
    drafter: Any,
    policy: TreePolicy,
    requests: Sequence[Request],
    served: Sequence[Any],
    labels: int,
) -> list[Any]:
    """The learner's feedback from an engine's replies: each reply replayed through our decoder
    with `drafter`, the one the engine served (features, soft labels and records, as a live
    generation would give), carrying the engine's decode seconds."""
    generations = []
    for request, item in zip(requests, served, strict=True):
        result = replay_request(
            target, drafter, policy, request.prompt, item.tokens, keep_labels=labels
        )
        result.total_seconds = item.seconds
        generations.append(result)
    return generations


def _rows_tau(rows: Sequence[dict[str, Any]]) -> float:
    """A round's tau from its rows' own tau and verify steps (committed over steps)."""
    steps = sum(r["verifications"] for r in rows)
    return sum(r["tau"] * r["verifications"] for r in rows if r["verifications"]) / steps if steps else float("nan")


def _request_row(
    index: int, request: Request, result: Any, greedy: Sequence[int] | None, *, replayed: bool
) -> dict[str, Any]:
    """One line of the request log; a live request with a known greedy answer is checked."""
    seconds = result.total_seconds
    row = {
        "round": index, "request": request.index, "domain": request.domain, "id": request.id,
        "tau": result.tau, "tokens": len(result.tokens), "verifications": result.num_verifications,
        "seconds": seconds,
        "tokens_per_s": len(result.tokens) / seconds if seconds > 0 and not replayed else None,
        "replayed": replayed,
    }  # fmt: skip
    if greedy and not replayed:
        row["greedy_match"] = matches_greedy(result.tokens, greedy)
    return row


def _round_figures(
    generations: Sequence[Any], rows: Sequence[dict[str, Any]], update: dict[str, Any]
) -> dict[str, Any]:
    """A round's tau, served and net tokens/s (update charged), the update's report and, for a
    live-checked round, its greedy mismatches. A replayed round's seconds are replay time, not
    serving time (a replayed step skips the decoding a live one pays for), so its tokens/s are
    NaN and the seconds are kept as ``replay_seconds``."""
    served = sum(g.total_seconds for g in generations)
    tokens = sum(len(g.tokens) for g in generations)
    verifications = sum(g.num_verifications for g in generations)
    committed = sum(sum(len(r.committed) for r in g.records) for g in generations)
    live = served > 0 and not any(r["replayed"] for r in rows)
    figures = {
        "requests": len(rows),
        "tau": committed / verifications if verifications else float("nan"),
        "tokens": float(tokens),
        "verifications": float(verifications),
        "tokens_per_s": tokens / served if live else float("nan"),
        "net_tokens_per_s": tokens / (served + update["update_seconds"]) if live else float("nan"),
        **update,
    }
    if rows and not live:
        figures["replay_seconds"] = served
    checked = [r["greedy_match"] for r in rows if "greedy_match" in r]
    if checked:
        figures["greedy_mismatches"] = float(checked.count(False))
    return figures


def matches_greedy(served: Sequence[int], greedy: Sequence[int]) -> bool:
    """Whether a live output agrees with the request's known greedy answer. The answer is cut
    to its batch-1 greedy prefix (`online.continuations`), so a lossless output starts with it."""
    return list(served[: len(greedy)]) == list(greedy)


def served_totals(rows: Sequence[dict[str, Any]]) -> tuple[float, float]:
    """(tokens, seconds) summed over the live requests among `rows`: served tokens/s is their
    ratio, not a mean of per-request rates (short answers would weigh as much as long ones).
    A replayed request's seconds are replay time, not serving time, so it is left out."""
    live = [r for r in rows if r.get("tokens_per_s") and r.get("seconds")]
    return float(sum(r["tokens"] for r in live)), float(sum(r["seconds"] for r in live))


def prequential_summary(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Means over every request served so far (each by the model that existed before it)."""
    taus = [r["tau"] for r in rows if r["tau"] is not None and math.isfinite(r["tau"])]
    tokens, seconds = served_totals(rows)
    return {
        "prequential_tau": sum(taus) / len(taus) if taus else float("nan"),
        "prequential_tokens_per_s": tokens / seconds if seconds else float("nan"),
        "served": float(len(rows)),
    }
