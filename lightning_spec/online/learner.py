"""The learner behind a running server: rounds of served traffic from the spool, an update, a
push, a checkpoint.

A round moves through four stages, each a function of the round so far:

1. `take`: the next `round_size` finished requests from the spool (`online.spool`), in the
   order the server finished them.
2. `feedback`: each request replayed with the drafter that served it, from the target rows the
   server captured (`online.loop.replay_captured`: no target forward). A request captured
   without rows, or whose rows fail the replay's greedy check, falls back to a target pass over
   its text (`online.loop.replay_request`), counted as ``fallback``; one whose text is not the
   target's greedy text (sampled at T > 0) or too short to learn from is skipped, counted.
3. `update`: the strategy learns from the round (`online.loop.guarded_update`).
4. `publish`: the new drafter is written under ``out_dir/drafters/`` (atomically) and pushed to
   the server with its sha256; a refused push leaves the previous drafter serving, and the
   learner then replays the next round with that one.

Before the update, the round's served acceptance (tau from the engine's own accepted counts) is
compared with the round before the last push: a pushed drafter whose traffic accepts less by
more than `rollback_margin` is rolled back (the previous drafter pushed again, the strategy's
state from before that update restored). After each round the checkpoint (``learner.pt``:
strategy state, the drafter served, the names of the spool files learned from) is written before
those files are marked done, so a learner killed anywhere resumes without learning a request
twice or losing one; the server serves the last good drafter meanwhile.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_spec.decoding.build import TreePolicy
from lightning_spec.decoding.replay import ReplayMismatch, committed_feedback
from lightning_spec.io import atomic_folder, atomic_path, atomic_write_json, sha256_file
from lightning_spec.online.engines import PushFailed
from lightning_spec.online.loop import guarded_update, replay_captured, replay_request
from lightning_spec.online.spool import SpoolEntry, SpoolReader
from lightning_spec.online.strategies import OnlineStrategy

log = logging.getLogger(__name__)

__all__ = [
    "LearnerSettings",
    "UpdateSchedule",
    "http_push",
    "round_feedback",
    "run_learner",
    "served_tau",
]

CHECKPOINT = "learner.pt"
ROUND_STATE = "learner_round.json"
ROUNDS = "rounds.jsonl"
Push = Callable[[Path, str], dict[str, Any]]


@dataclass
class LearnerSettings:
    out_dir: Path
    round_size: int = 40
    rollback_margin: float = 0.1
    """A pushed drafter whose next round's served tau is this much (relative) below the round
    before the push is rolled back."""
    poll_seconds: float = 0.25
    """How often the spool is listed for a full round (a directory listing: cheap; a client
    that waits for the learner waits up to this long for nothing)."""
    keep_drafters: int = 3
    keep_learned: bool = False
    """Keep the spool files learned from (in ``spool/done/``) instead of deleting them."""
    max_rounds: int | None = None
    update_growth: float = 1.0
    """The update schedule (`UpdateSchedule`): 1 learns from every round; above 1 the gap between
    updates grows by this factor after each one, up to `max_gap` rounds."""
    max_gap: int = 8
    drift_margin: float = 0.1
    """A round whose served tau falls this much (relative) below the recent rounds' mean is drift:
    the schedule learns from it and every round after it again."""


class UpdateSchedule:
    """When the learner pays for an update, from the acceptance served on the newest traffic.

    An update costs the same seconds whenever it runs, but what it buys shrinks as the drafter
    settles into the stream: early rounds teach the domain's tokens, later ones add little. So
    the gap between updates grows geometrically (1, 1, 2, 3, 5, ... rounds at a growth of 1.5,
    up to `max_gap`), and drops back to every round when the served tau of a round falls below
    the mean of the recent rounds by `drift_margin` (the traffic moved: learn again). The served
    tau is the engine's own count, free; a skipped round costs nothing, not even its features.
    """

    def __init__(self, growth: float = 1.0, max_gap: int = 8, drift_margin: float = 0.1,
                 window: int = 4) -> None:  # fmt: skip
        if growth < 1.0 or max_gap < 1 or not 0.0 <= drift_margin < 1.0:
            raise ValueError("the schedule needs growth >= 1, max_gap >= 1, 0 <= drift_margin < 1")
        self.growth, self.max_gap, self.drift_margin = float(growth), int(max_gap), drift_margin
        self.window = int(window)
        self.gap, self.next_round, self.recent = 1.0, 0, []

    def decide(self, index: int, tau: float) -> str:
        """``"learn"``, ``"drift"`` (learn, the gap reset) or ``"skip"`` for round `index`."""
        recent = [t for t in self.recent[-self.window :] if t == t]
        self.recent = (self.recent + [tau])[-self.window :]
        if (recent and tau == tau and self.growth > 1.0
                and tau < sum(recent) / len(recent) * (1 - self.drift_margin)):  # fmt: skip
            self.gap, self.next_round = 1.0, index + 1
            return "drift"
        if index < self.next_round:
            return "skip"
        self.next_round = index + max(1, int(self.gap))
        self.gap = min(self.gap * self.growth, float(self.max_gap))
        return "learn"

    def state_dict(self) -> dict[str, Any]:
        return {"gap": self.gap, "next_round": self.next_round, "recent": list(self.recent)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.gap, self.next_round = float(state["gap"]), int(state["next_round"])
        self.recent = list(state["recent"])


def http_push(url: str, timeout: float = 600.0) -> Push:
    """A `Push` through the server's ``POST /lightning-spec/push`` (`online.vllm_routes`)."""

    def push(folder: Path, sha256: str) -> dict[str, Any]:
        body = json.dumps({"folder": str(folder), "sha256": sha256}).encode()
        request = urllib.request.Request(f"{url}/lightning-spec/push", data=body, method="POST",
                                         headers={"content-type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=timeout) as answer:
                return json.loads(answer.read())
        except urllib.error.HTTPError as error:
            raise PushFailed(f"{error.code}: {error.read().decode(errors='replace')}") from error
        except (urllib.error.URLError, OSError) as error:
            raise PushFailed(f"the server did not answer: {error}") from error

    return push


def served_tau(entries: list[SpoolEntry]) -> float:
    """Tokens committed per verification step over the round, from the engine's own counts."""
    steps = sum(len(e.request.accepted) for e in entries)
    return (
        (sum(sum(e.request.accepted) for e in entries) + steps) / steps if steps else float("nan")
    )


def round_feedback(
    target: Any, drafter: Any, policy: TreePolicy, entries: list[SpoolEntry], labels: int,
    *, records: bool = True,
) -> tuple[list[Any], Counter[str]]:  # fmt: skip
    """The round's generations (stage 2 of the module docstring) and what each request took.
    ``records=False`` (a strategy that reads only the committed text, `reads_records`): the
    captured rows give features and labels directly, with no drafter replay (the records a
    replay would add go unread)."""
    generations, counts = [], Counter()
    for entry in entries:
        request = entry.request
        prompt, answer = (
            request.computed[: request.prompt_len],
            request.computed[request.prompt_len :],
        )
        if not answer:
            counts["skipped_too_short"] += 1
            continue
        try:
            if records:
                generation = replay_captured(target, drafter, policy, request, keep_labels=labels)
            else:
                generation = committed_feedback(
                    target, prompt, answer, keep_labels=labels, text=request.text_pass()
                )
            generations.append(generation)
            counts["captured"] += 1
            continue
        except (
            ValueError,
            ReplayMismatch,
        ) as error:  # no rows kept, or rows failing the greedy check
            log.warning(
                "%s: captured rows unusable (%s); a target pass instead", request.request_id, error
            )
        try:
            if records:
                generation = replay_request(
                    target, drafter, policy, prompt, answer, keep_labels=labels
                )
            else:
                generation = committed_feedback(target, prompt, answer, keep_labels=labels)
            generations.append(generation)
            counts["fallback"] += 1
        except (
            ValueError,
            ReplayMismatch,
        ):  # not the target's greedy text: nothing to replay at T = 0
            counts["skipped_not_greedy"] += 1
    return generations, counts


def run_learner(
    target: Any,
    strategy: OnlineStrategy,
    policy: TreePolicy,
    reader: SpoolReader,
    push: Push,
    settings: LearnerSettings,
    *,
    stop: Callable[[], bool] = lambda: False,
) -> list[dict[str, Any]]:
    """Learn from the spool round after round until `stop()` (or `max_rounds`); returns the
    rounds' rows (also appended to ``out_dir/rounds.jsonl``)."""
    out = Path(settings.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    schedule = UpdateSchedule(settings.update_growth, settings.max_gap, settings.drift_margin)
    state = _resume(out, strategy, reader, settings.keep_learned, schedule)
    served = copy.deepcopy(strategy.drafter)  # what the server serves (a refused push keeps it)
    if state["served_state"] is not None:
        served.load_state_dict(state["served_state"])
    if state["served_folder"] is not None:  # a restarted server starts from its --drafter again
        _push_served(push, state)
    rows: list[dict[str, Any]] = []
    while not stop() and (settings.max_rounds is None or len(rows) < settings.max_rounds):
        # count the files before loading any: loading a growing round's captured rows every
        # poll took the cores the server was serving on
        if len(reader.pending()) < settings.round_size:
            time.sleep(settings.poll_seconds)
            continue
        entries = reader.take(limit=settings.round_size)
        if len(entries) < settings.round_size:  # unreadable files were set aside
            continue
        index = state["round"] + 1
        row: dict[str, Any] = {
            "round": index,
            "requests": len(entries),
            "served_tau": served_tau(entries),
        }
        if _maybe_roll_back(state, strategy, served, push, row, settings.rollback_margin):
            row["learned"] = 0  # served by the drafter just rolled back: not learned from
        elif (decision := schedule.decide(index, row["served_tau"])) == "skip":
            row["learned"] = 0  # the schedule's gap: this round's seconds go to serving
        else:
            row["schedule"] = decision
            _learn(target, strategy, policy, served, entries, push, out, index, state, row)
        state.update(round=index, served_state=served.state_dict(), schedule=schedule.state_dict())
        changed = "schedule" in row or "rollback" in row  # an update or a rollback ran
        _checkpoint(out, strategy, state, [e.path.name for e in entries], full=changed)
        reader.done(entries, keep=settings.keep_learned)
        _prune(out, settings.keep_drafters, state)
        rows.append(row)
        with open(out / ROUNDS, "a") as handle:
            handle.write(json.dumps(row) + "\n")
        log.info("learner round %d: %d requests, served tau %.3f, learned from %d", index,
                 len(entries), row["served_tau"], row.get("learned", 0))  # fmt: skip
    return rows


def _learn(target: Any, strategy: OnlineStrategy, policy: TreePolicy, served: Any,
           entries: list[SpoolEntry], push: Push, out: Path, index: int, state: dict[str, Any],
           row: dict[str, Any]) -> None:  # fmt: skip
    """Stages 2-4 of the module docstring for one round; `row` gets their counts and seconds."""
    tic = time.perf_counter()
    generations, counts = round_feedback(target, served, policy, entries, strategy.label_top_k,
                                         records=strategy.reads_records)  # fmt: skip
    row.update(counts, learned=len(generations), feedback_seconds=time.perf_counter() - tic)
    if not generations:
        return
    before_update = copy.deepcopy(strategy.state_dict())
    tic = time.perf_counter()
    update = guarded_update(target, strategy, policy, generations, None)
    row.update({k: v for k, v in update.items() if isinstance(v, (int, float))},
               step_seconds=time.perf_counter() - tic)  # fmt: skip
    if strategy.name == "frozen":
        return
    published = _publish(out, index, strategy, push, row)
    if published is not None:
        served.load_state_dict(strategy.drafter.state_dict())
        state.update(previous=(state["served_folder"], before_update), served_folder=published,
                     tau_before_push=row["served_tau"])  # fmt: skip


def _maybe_roll_back(state: dict[str, Any], strategy: OnlineStrategy, served: Any, push: Push,
                     row: dict[str, Any], margin: float) -> bool:  # fmt: skip
    """Roll the last push back when this round (served by it) accepts less than the round
    before it by more than `margin`; True when it did."""
    before, previous = state.get("tau_before_push"), state.get("previous")
    state["tau_before_push"] = None  # one verdict per push
    if before is None or previous is None or not row["served_tau"] < before * (1 - margin):
        return False
    folder, strategy_state = previous
    row["rollback"] = 1.0
    log.warning("pushed drafter served tau %.3f against %.3f before it: rolling back",
                row["served_tau"], before)  # fmt: skip
    if folder is not None:
        try:
            push(Path(folder), sha256_file(Path(folder) / "model.safetensors"))
        except PushFailed as error:
            row["rollback_push_failed"] = 1.0
            log.warning("rollback push refused: %s", error)
            return True
    strategy.load_state_dict(strategy_state)
    served.load_state_dict(strategy.drafter.state_dict())
    state.update(served_folder=folder, previous=None)
    return True


def _publish(
    out: Path, index: int, strategy: OnlineStrategy, push: Push, row: dict[str, Any]
) -> str | None:
    tic = time.perf_counter()
    folder = out / "drafters" / f"round-{index:05d}"
    with atomic_folder(folder) as staging:
        strategy.drafter.save_pretrained(staging)
    sha = sha256_file(folder / "model.safetensors")
    try:
        push(folder, sha)
    except PushFailed as error:
        log.warning("push of round %d refused; the server keeps its drafter: %s", index, error)
        row.update(push_failed=1.0, push_seconds=time.perf_counter() - tic)
        return None
    row.update(push_failed=0.0, push_seconds=time.perf_counter() - tic, served_sha256=sha)
    return str(folder)


def _checkpoint(
    out: Path, strategy: OnlineStrategy, state: dict[str, Any], learned: list[str],
    *, full: bool = True,
) -> None:  # fmt: skip
    """The round's light state (`ROUND_STATE`: round, schedule, push verdict, the files taken)
    every round; the whole state (`CHECKPOINT`: the strategy, the served drafter and the one
    before it) only when `full`, after a round that changed them (an update, a rollback). A
    SmolLM2 drafter's whole state with its AdamW moments is ~600 MB: written after every
    skipped round, it cost a learner charged to serving ~3 s a round for nothing new."""
    if full:
        with atomic_path(out / CHECKPOINT) as tmp:
            torch.save({**state, "strategy": strategy.state_dict(), "learned": learned}, tmp)
    light = {"round": state["round"], "schedule": state.get("schedule"),
             "tau_before_push": state.get("tau_before_push"), "learned": learned}  # fmt: skip
    atomic_write_json(out / ROUND_STATE, light)


def _push_served(push: Push, state: dict[str, Any]) -> None:
    """Push the drafter the checkpoint says is served: a learner resumed beside a restarted
    server would otherwise learn from traffic served by the server's starting drafter."""
    folder = Path(state["served_folder"])
    try:
        push(folder, sha256_file(folder / "model.safetensors"))
        log.info("learner resumed: pushed %s, the drafter it last served", folder)
    except (PushFailed, OSError) as error:
        log.warning("learner resumed, but the drafter it served could not be pushed: %s", error)


def _resume(out: Path, strategy: OnlineStrategy, reader: SpoolReader, keep: bool,
            schedule: UpdateSchedule) -> dict[str, Any]:  # fmt: skip
    state: dict[str, Any] = {"round": -1, "served_folder": None, "served_state": None,
                             "previous": None, "tau_before_push": None}  # fmt: skip
    path = out / CHECKPOINT
    saved = torch.load(path, map_location="cpu", weights_only=False) if path.is_file() else {}
    if saved:
        strategy.load_state_dict(saved.pop("strategy"))
    learned = set(saved.pop("learned", []))
    light_path = out / ROUND_STATE
    light = json.loads(light_path.read_text()) if light_path.is_file() else None
    if light is not None and light["round"] > saved.get("round", state["round"]):
        # rounds after the last whole checkpoint were skipped: they changed only this
        learned = set(light["learned"])
        saved.update(round=light["round"], schedule=light["schedule"],
                     tau_before_push=light["tau_before_push"])  # fmt: skip
    if not saved:
        return state
    # killed between the checkpoint and marking its files done: mark them now
    reader.done([SpoolEntry(p, None) for p in reader.pending() if p.name in learned], keep=keep)
    if saved.get("schedule"):
        schedule.load_state_dict(saved["schedule"])
    state.update(saved)
    log.info("learner resumed after round %d from %s", state["round"], path)
    return state


def _prune(out: Path, keep: int, state: dict[str, Any]) -> None:
    """Keep the newest `keep` drafter folders and any the rollback may need."""
    needed = {state.get("served_folder")} | {(state.get("previous") or (None,))[0]}
    folders = sorted((out / "drafters").glob("round-*")) if (out / "drafters").is_dir() else []
    for folder in folders[:-keep] if keep > 0 else folders:
        if str(folder) not in needed:
            shutil.rmtree(folder, ignore_errors=True)
