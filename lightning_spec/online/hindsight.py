"""The hindsight ceiling of an online stream: how much of the learnable signal was there.

Online learning sees each request once, after serving it. Its ceiling on a stream is a drafter
fitted with hindsight: the same learner (the configured strategy's update) run over the first
`fraction` of the stream's requests for several epochs, then frozen and served on the rest. Its
tau on those last requests, beside the online strategies' tau on the same requests, says what
share of the stream's learnable signal online learning captured (the reference's
offline counterpart of its online rounds).

At T = 0 only (the requests are replayed over their cached greedy answers,
`online.continuations`). A learner that reads only the committed text (`ogd`, `ensemble`,
`optimistic`) is fitted on feedback computed once, one teacher-forced pass per request
(`decoding.replay.committed_feedback`); one that reads the rejected drafts (`osd`, `dpo`) is
replayed with the drafter being fitted, every epoch. The fit checkpoints after each epoch (`hindsight_fit.pt`), so a killed run
resumes at its epoch; the frozen serving of the rest is `run_stream` with its own resume.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_spec.decoding.build import TreePolicy
from lightning_spec.decoding.replay import committed_feedback
from lightning_spec.io import atomic_path, atomic_write_json
from lightning_spec.online.loop import replay_request, run_stream
from lightning_spec.online.strategies import FrozenStrategy, OnlineStrategy
from lightning_spec.online.stream import Request
from lightning_spec.progress import progress_bar

log = logging.getLogger(__name__)

__all__ = ["FIT_CHECKPOINT", "SUMMARY", "hindsight_split", "run_hindsight"]

FIT_CHECKPOINT = "hindsight_fit.pt"
SUMMARY = "hindsight.json"


def hindsight_split(count: int, fraction: float) -> int:
    """How many leading requests of `count` the hindsight drafter is fitted on (>= 1, and at
    least one request is left to score)."""
    if not 0 < fraction < 1:
        raise ValueError(f"the hindsight fraction must lie in (0, 1), got {fraction}")
    if count < 2:
        raise ValueError("a hindsight ceiling needs at least two requests (fit and score)")
    return min(count - 1, max(1, round(count * fraction)))


def _committed_feedback(
    target: Any, requests: Sequence[Request], continuations: Sequence[Sequence[int]], labels: int
) -> list[Any]:
    """`committed_feedback` of every request, with progress (one target pass each)."""
    out = []
    with progress_bar("hindsight feedback (one target pass per request)") as bar:
        task = bar.add_task("requests", total=len(requests))
        for request, answer in zip(requests, continuations, strict=True):
            out.append(committed_feedback(target, request.prompt, answer, keep_labels=labels))
            bar.update(task, advance=1)
    return out


def run_hindsight(
    target: Any,
    strategy: OnlineStrategy,
    policy: TreePolicy,
    requests: Sequence[Request],
    continuations: Sequence[Sequence[int]] | None,
    *,
    out_dir: str | Path,
    fraction: float = 0.7,
    epochs: int = 3,
    round_size: int = 25,
    max_new_tokens: int = 64,
    logger: Any = None,
) -> list[dict[str, Any]]:
    """Fit `strategy` on the first `fraction` of `requests` for `epochs` passes (chunks of
    `round_size`, in stream order), then serve the rest frozen; returns their request log
    (rows as `run_stream`'s, carrying each request's stream index for pairing)."""
    if continuations is None or len(continuations) != len(requests) or not all(continuations):
        raise ValueError(
            "the hindsight ceiling replays the stream's greedy answers: set `replay: true` "
            "(every request needs its cached continuation)"
        )
    if epochs < 1:
        raise ValueError(f"hindsight epochs must be >= 1, got {epochs}")
    cut = hindsight_split(len(requests), fraction)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = out / FIT_CHECKPOINT
    done = 0
    if checkpoint.is_file():
        state = torch.load(checkpoint, map_location="cpu", weights_only=False)
        strategy.load_state_dict(state["strategy"])
        done = int(state["epochs"])
        log.info("hindsight fit resumed after epoch %d of %d", done, epochs)
    tic = time.perf_counter()
    fixed = None
    if done < epochs and not strategy.reads_records:
        # the learner reads only the committed text, its features and labels: at T = 0 they do
        # not depend on the drafter, so one teacher-forced pass per request serves every epoch
        fixed = _committed_feedback(target, requests[:cut], continuations[:cut],
                                    strategy.label_top_k)  # fmt: skip
    for epoch in range(done, epochs):
        losses = []
        with progress_bar(f"hindsight fit, epoch {epoch + 1}/{epochs}") as bar:
            task = bar.add_task("requests", total=cut)
            for begin in range(0, cut, round_size):
                chunk = range(begin, min(cut, begin + round_size))
                if fixed is not None:
                    generations = [fixed[i] for i in chunk]
                else:  # records of the drafter being fitted: replayed with it, every epoch
                    generations = [
                        replay_request(
                            target, strategy.drafter, policy, requests[i].prompt,
                            continuations[i], keep_labels=strategy.label_top_k,
                        )
                        for i in chunk
                    ]  # fmt: skip
                report = strategy.update(generations)  # its online_loss: before this update
                if report.get("online_loss") == report.get("online_loss"):
                    losses.append(float(report["online_loss"]))
                bar.update(task, advance=len(chunk))
        with atomic_path(checkpoint) as tmp:
            torch.save({"epochs": epoch + 1, "strategy": strategy.state_dict()}, tmp)
        mean = sum(losses) / len(losses) if losses else float("nan")
        log.info("hindsight fit: epoch %d/%d on %d requests, loss %.4f (%.0f s so far)",
                 epoch + 1, epochs, cut, mean, time.perf_counter() - tic)  # fmt: skip
        if logger is not None and losses:
            logger.log_metrics({"hindsight/fit_loss": mean}, epoch)
    fit_seconds = time.perf_counter() - tic
    frozen = FrozenStrategy(strategy.drafter)
    rows = run_stream(
        target,
        frozen,
        policy,
        requests[cut:],
        out_dir=out,
        round_size=round_size,
        max_new_tokens=max_new_tokens,
        logger=logger,
        continuations=continuations[cut:],
    )
    taus = [r["tau"] for r in rows if r["tau"] == r["tau"]]
    atomic_write_json(
        out / SUMMARY,
        {
            "fit_requests": cut,
            "scored_requests": len(rows),
            "epochs": epochs,
            "fraction": fraction,
            "strategy": strategy.name,
            "fit_seconds_this_run": fit_seconds,
            "tau": sum(taus) / len(taus) if taus else None,
        },
    )
    return rows
