"""Learning curves by exact replay: held-out acceptance every N minutes, and the error-fix rate.

The claim Draft-OPD and GTO make against SFT is about the shape of training: SFT plateaus, the
on-policy method keeps rising. Reading that needs acceptance measured often, cheaply and on
the same texts every time. At T = 0 the target's greedy answer to a prompt does not depend on
the drafter, so this callback generates the held-out prompts' greedy answers once (batched, at
fit start), keeps the target's teacher-forced pass over each, and at every evaluation replays
the current drafter over them with the decoder's own exact replay (`decoding.replay`): the tau
and per-depth acceptance a real greedy decode would give, at the cost of drafting only.

The error-fix rate: at fit start the starting drafter is replayed on `train_texts` training
prompts and its first errors are kept (each verification step's anchor and the slot where its
chain first went wrong). At each evaluation, the share of those the current drafter no longer
makes (its chain at the same anchor now gets past that slot): a method that learns from its own
errors should fix them faster than SFT on the same texts does.

Evaluations run at train start, every `every_minutes` of training wall clock, and at train end;
metrics go to the logger under ``replay/`` with ``replay/minutes`` (the training wall clock),
so curves can be drawn against time as well as steps.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

log = logging.getLogger(__name__)

__all__ = ["ReplayAcceptance"]


@dataclass
class _Text:
    prompt: list[int]
    answer: list[int]
    text: Any  # decoding.replay.TextPass


class ReplayAcceptance(Callback):
    """Replayed held-out tau, alpha_k and the error-fix rate over training (module doc)."""

    def __init__(
        self,
        num_prompts: int = 48,
        max_new_tokens: int = 64,
        tree: str = "chain:6",
        every_minutes: float = 10.0,
        train_texts: int = 32,
        batch_size: int = 8,
    ) -> None:
        """
        Args:
            num_prompts: Held-out prompts (the datamodule's ``eval_prompts``) replayed.
            max_new_tokens: Greedy answer length per prompt.
            tree: The tree (``chain:K`` for chain drafters; any policy works).
            every_minutes: Training wall-clock minutes between evaluations.
            train_texts: Training prompts whose starting-drafter errors are tracked (0 = off).
            batch_size: Prompts per batched greedy generation (once, at fit start).
        """
        super().__init__()
        from lightning_spec.decoding.build import parse_tree_spec

        if num_prompts < 1 or max_new_tokens < 1 or every_minutes <= 0 or train_texts < 0:
            raise ValueError(
                "ReplayAcceptance needs num_prompts >= 1, max_new_tokens >= 1, "
                "every_minutes > 0 and train_texts >= 0"
            )
        self.policy = parse_tree_spec(tree)
        self.tree = tree
        self.num_prompts = num_prompts
        self.max_new_tokens = max_new_tokens
        self.every_seconds = 60.0 * float(every_minutes)
        self.train_texts = train_texts
        self.batch_size = batch_size
        self.history: list[dict[str, Any]] = []
        self._held_out: list[_Text] = []
        self._train: list[_Text] = []
        self._errors: list[tuple[int, int, int]] = []  # (text, anchor, first wrong slot)
        self._trained_seconds = 0.0
        self._since = 0.0
        self._tic: float | None = None

    # ---------------------------------------------------------------------------- texts
    def _texts(self, module: LightningModule, prompts: list[list[int]]) -> list[_Text]:
        """Each prompt with its greedy answer (cut to the batch-1 greedy prefix) and the
        target's pass over it: what every later replay reads."""
        from lightning_spec.data.regenerate import greedy_answers
        from lightning_spec.decoding.replay import greedy_prefix, text_pass

        target, drafter = module.target, module.drafter
        answers = greedy_answers(
            target, prompts, max_new_tokens=self.max_new_tokens, batch_size=self.batch_size
        )
        texts = []
        for prompt, answer in zip(prompts, answers, strict=True):
            if len(answer) < 2:
                continue
            ids = torch.tensor([prompt + answer], device=target.device)
            text = text_pass(target, ids, len(prompt), features=drafter.needs_features)
            keep = greedy_prefix(target, text, answer)
            if keep < 2:
                continue
            texts.append(_Text(prompt, answer[:keep], text.prefix(len(prompt), keep)))
        return texts

    def _replay(self, module: LightningModule, item: _Text) -> Any:
        from lightning_spec.decoding.replay import replay_greedy

        return replay_greedy(
            module.target, module.drafter, self.policy, item.prompt, item.answer, text=item.text
        )

    # ---------------------------------------------------------------------------- evaluation
    def evaluate(self, module: LightningModule) -> dict[str, float]:
        """The replayed metrics of the module's current drafter (public for benches/tests)."""
        from lightning_spec.metrics import AcceptanceLength, PerDepthAcceptance

        drafter = module.drafter
        was_training = drafter.training
        drafter.eval()
        tau = AcceptanceLength()
        alpha = PerDepthAcceptance(int(self.policy.max_depth))
        try:
            with torch.no_grad():
                for item in self._held_out:
                    records = self._replay(module, item).records
                    tau.update_from_records(records)
                    alpha.update_from_records(records)
                fixed = self._fixed(module)
        finally:
            drafter.train(was_training)
        metrics = {"replay/tau": float(tau.compute())}
        for depth, value in enumerate(alpha.compute().tolist(), start=1):
            metrics[f"replay/alpha_{depth}"] = float(value)
        if fixed is not None:
            metrics["replay/error_fix_rate"] = fixed
        return metrics

    def _first_errors(self, module: LightningModule) -> list[tuple[int, int, int]]:
        errors = []
        with torch.no_grad():
            for index, item in enumerate(self._train):
                for record in self._replay(module, item).records:
                    if record.bonus_committed and record.first_rejected >= 0:
                        errors.append((index, record.anchor, record.accept_length))
        return errors

    def _fixed(self, module: LightningModule) -> float | None:
        """The share of the starting drafter's first errors the current drafter gets past."""
        if not self._errors:
            return None
        target, drafter = module.target, module.drafter
        fixed = 0
        by_text: dict[int, list[tuple[int, int]]] = {}
        for index, anchor, n in self._errors:
            by_text.setdefault(index, []).append((anchor, n))
        for index, errors in by_text.items():
            item = self._train[index]
            ids = torch.tensor([item.prompt + item.answer], device=target.device)
            roots = torch.tensor([a for a, _ in errors], device=target.device)
            proposer = drafter.sequence_proposer(ids, roots, features=item.text.features)
            trees = self.policy.build_batch(proposer, temperature=0.0)
            proposer.finish()
            for tree, (anchor, n) in zip(trees, errors, strict=True):
                # past the slot when the tree holds the text's next n + 1 tokens as a path
                following = ids[0, anchor + 1 : anchor + n + 2].cpu()
                fixed += int(_holds_path(tree, following))
        return fixed / len(self._errors)

    # ---------------------------------------------------------------------------- hooks
    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        datamodule = getattr(trainer, "datamodule", None)
        if datamodule is None or not hasattr(datamodule, "eval_prompts"):
            raise ValueError("ReplayAcceptance needs a datamodule with eval_prompts(n)")
        tic = time.perf_counter()
        with torch.no_grad():
            if not self._held_out:
                self._held_out = self._texts(pl_module, datamodule.eval_prompts(self.num_prompts))
            if self.train_texts and not self._train and hasattr(datamodule, "train_prompts"):
                self._train = self._texts(pl_module, datamodule.train_prompts(self.train_texts))
                if not self._errors:  # a resumed run keeps the starting drafter's errors
                    self._errors = self._first_errors(pl_module)
        log.info("replay eval: %d held-out texts, %d training texts (%d first errors) in %.0f s",
                 len(self._held_out), len(self._train), len(self._errors),
                 time.perf_counter() - tic)  # fmt: skip
        if not self.history:
            self._log(trainer, pl_module)
        self._tic = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        now = time.perf_counter()
        if self._tic is not None:
            self._trained_seconds += now - self._tic
            self._since += now - self._tic
        if self._since >= self.every_seconds:
            self._log(trainer, pl_module)
            self._since = 0.0
        self._tic = time.perf_counter()  # evaluation time is not training time

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.history or self.history[-1]["step"] != int(trainer.global_step):
            self._log(trainer, pl_module)

    def _log(self, trainer: Trainer, pl_module: LightningModule) -> None:
        metrics = self.evaluate(pl_module)
        metrics["replay/minutes"] = self._trained_seconds / 60.0
        step = int(trainer.global_step)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
        self.history.append({"step": step, **metrics})
        log.info("replay eval at step %d (%.1f min): tau %.3f%s", step, metrics["replay/minutes"],
                 metrics["replay/tau"], "" if "replay/error_fix_rate" not in metrics
                 else f", error-fix rate {metrics['replay/error_fix_rate']:.3f}")  # fmt: skip

    # ---------------------------------------------------------------------------- resume
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history, "trained_seconds": self._trained_seconds,
                "errors": self._errors}  # fmt: skip

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = list(state_dict.get("history", []))
        self._trained_seconds = float(state_dict.get("trained_seconds", 0.0))
        self._errors = [tuple(e) for e in state_dict.get("errors", [])]  # type: ignore[misc]


def _holds_path(tree: Any, following: torch.Tensor) -> bool:
    """Whether `tree` has a root path whose tokens are `following` [m] (depth 1 first)."""
    tokens, parents = tree.tokens.cpu(), tree.parents.cpu()
    node = -1
    for token in following.tolist():
        children = ((parents == node) & (tokens == token)).nonzero().flatten()
        if children.numel() == 0:
            return False
        node = int(children[0])
    return True
