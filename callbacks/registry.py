"""Register the trained drafter in the MLflow model registry at the end of `fit`, and promote it.

At `on_fit_end` (global rank 0 only) this callback takes the best drafter folder
(`DrafterCheckpoint`'s `best/`, else `last/`, or `drafter_dir`), logs it as a model version of
`model_name` in the trainer's MLflow run (the `MLFlowLogger`'s run and tracking URI; without
one, a new run in a local SQLite store beside the run folder), with the tau that
`AcceptanceEval` logged for that very checkpoint (same global step), then applies the
promotion rule (`lightning_spec.registry.promote`): the `champion` alias moves to it only when
it beats the champion by more than `margin` on the same prompts, temperature and tree policy;
otherwise it becomes `challenger`.

The prompt set is named after its content (`val-<hash of the token ids>`), so figures from two
runs are compared directly only when both measured the very same prompts; otherwise both
drafters are re-measured side by side on this run's prompts. Tree, temperature and max new
tokens default to the `AcceptanceEval` callback's.

A registry failure at the end of a long run does not throw the run away: the drafter folders
are already on disk, the error is logged with the `lightning-spec promote` command that
registers them later, and `strict=True` re-raises instead.

YAML: `class_path: lightning_spec.callbacks.registry.RegisterDrafter`,
`init_args: {model_name: smollm2-eagle3}`.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_spec.callbacks.acceptance import AcceptanceEval
from lightning_spec.callbacks.checkpoint import STATE_FILE, DrafterCheckpoint

log = logging.getLogger(__name__)

__all__ = ["RegisterDrafter", "prompt_set_digest"]


def prompt_set_digest(prompts: list[list[int]], prefix: str = "val") -> str:
    """`val-<8 hex>`: a label that names token-id prompts by their content."""
    digest = hashlib.sha1(json.dumps(prompts, separators=(",", ":")).encode()).hexdigest()
    return f"{prefix}-{digest[:8]}"


class RegisterDrafter(Callback):
    """Register the best drafter at the end of fit and apply the promotion rule."""

    def __init__(
        self,
        model_name: str,
        margin: float = 0.05,
        drafter_dir: str | None = None,
        prompt_set: str | None = None,
        tree: str | None = None,
        temperature: float | None = None,
        max_new_tokens: int | None = None,
        num_prompts: int = 20,
        prompts: list[list[int]] | None = None,
        objective: str | None = None,
        tracking_uri: str | None = None,
        experiment_name: str = "lightning-spec-registry",
        measure_if_missing: bool = True,
        strict: bool = False,
    ) -> None:
        """
        Args:
            model_name: Registered model name (one per target and drafter family).
            margin: The candidate must beat the champion's tau by more than this.
            drafter_dir: Folder to register; default DrafterCheckpoint's best/, else last/.
            prompt_set: Label of the prompts; default `val-<hash>` of the token ids.
            tree: Tree policy of the figures; default AcceptanceEval's (else chain:4).
            temperature: Default AcceptanceEval's (else 0).
            max_new_tokens: Default AcceptanceEval's (else 64).
            num_prompts: Prompts asked from the datamodule when there is no AcceptanceEval.
            prompts: Token-id prompts (else AcceptanceEval's, else `datamodule.eval_prompts`).
            objective: Training objective recorded in the metadata; default the module's class.
            tracking_uri: Store when the trainer has no MLFlowLogger (default: SQLite beside
                the run folder, or $MLFLOW_TRACKING_URI).
            experiment_name: Experiment of the registration run when there is no MLFlowLogger.
            measure_if_missing: Measure the drafter when AcceptanceEval logged no figure for it.
            strict: Re-raise registry errors instead of logging them.
        """
        super().__init__()
        if margin < 0:
            raise ValueError(f"margin must be >= 0, got {margin}")
        self.model_name = model_name
        self.margin = float(margin)
        self.drafter_dir = drafter_dir
        self.prompt_set = prompt_set
        self.tree = tree
        self.temperature = temperature
        self.max_new_tokens = max_new_tokens
        self.num_prompts = num_prompts
        self.prompts = [list(map(int, p)) for p in prompts] if prompts is not None else None
        self.objective = objective
        self.tracking_uri = tracking_uri
        self.experiment_name = experiment_name
        self.measure_if_missing = measure_if_missing
        self.strict = strict
        self.version: Any = None
        self.decision: Any = None

    # ---------------------------------------------------------------------------- lookups
    @staticmethod
    def _find(trainer: Trainer, kind: type) -> Any:
        return next((c for c in trainer.callbacks if isinstance(c, kind)), None)

    def folder(self, trainer: Trainer) -> Path | None:
        """The drafter folder to register (see `drafter_dir`)."""
        if self.drafter_dir is not None:
            return Path(self.drafter_dir).expanduser()
        checkpoint = self._find(trainer, DrafterCheckpoint)
        if checkpoint is None:
            return None
        for path in (checkpoint.best_path(trainer), checkpoint.last_path(trainer)):
            if (path / "config.json").is_file():
                return path
        return None

    def _prompts(self, trainer: Trainer, evaluator: AcceptanceEval | None) -> list[list[int]]:
        if self.prompts is not None:
            return self.prompts
        if evaluator is not None:
            return evaluator._prompts(trainer)
        datamodule = getattr(trainer, "datamodule", None)
        if datamodule is not None and hasattr(datamodule, "eval_prompts"):
            return [list(map(int, p)) for p in datamodule.eval_prompts(self.num_prompts)]
        raise ValueError(
            "RegisterDrafter needs prompts: add AcceptanceEval, give the datamodule "
            "eval_prompts(n), or pass prompts=[[token ids], ...]"
        )

    @staticmethod
    def _logged_tau(folder: Path, evaluator: AcceptanceEval | None) -> float | None:
        """The tau AcceptanceEval logged at the global step the folder was written."""
        state_path = folder / STATE_FILE
        if not state_path.is_file():
            return None
        state = json.loads(state_path.read_text())
        step = state.get("global_step")
        if evaluator is not None:
            for entry in reversed(evaluator.history):
                if entry.get("step") == step and entry.get("tau") is not None:
                    return float(entry["tau"])
        if state.get("monitor") == "val/tau" and state.get("value") is not None:
            return float(state["value"])
        return None

    def _tracking(self, trainer: Trainer) -> tuple[str, str | None]:
        from lightning.pytorch.loggers import MLFlowLogger

        for logger in trainer.loggers:
            if isinstance(logger, MLFlowLogger):
                if getattr(logger, "offline", False):  # SpecMLFlowLogger lost its store
                    raise ConnectionError(
                        f"the MLflow logger went offline ({logger._tracking_uri} unreachable)"
                    )
                return logger._tracking_uri, logger.run_id
        from lightning_spec.tracking import default_tracking_uri

        return self.tracking_uri or default_tracking_uri(trainer.default_root_dir), None

    # ---------------------------------------------------------------------------- hook
    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        folder = self.folder(trainer)
        try:
            if folder is None:
                raise FileNotFoundError(
                    "RegisterDrafter found no drafter folder: add DrafterCheckpoint or set "
                    "drafter_dir"
                )
            self.register(trainer, pl_module, folder)
        except Exception as error:
            if self.strict:
                raise
            log.error(
                "RegisterDrafter: registering %s as %r failed (%s: %s). The drafter folder is "
                "kept; register it later with `lightning-spec promote --drafter %s "
                "--model-name %s`.",
                folder,
                self.model_name,
                type(error).__name__,
                error,
                folder,
                self.model_name,
            )

    def register(self, trainer: Trainer, pl_module: LightningModule, folder: Path) -> Any:
        """Register `folder` and promote it; returns the `Decision` (also `self.decision`)."""
        from lightning_spec.registry import (
            bench_measure,
            drafter_metadata,
            promote,
            register_drafter,
            tau_key,
        )

        evaluator = self._find(trainer, AcceptanceEval)
        tree = self.tree or (evaluator.tree if evaluator else "chain:4")
        temperature = (
            self.temperature
            if self.temperature is not None
            else (evaluator.temperature if evaluator else 0.0)
        )
        max_new_tokens = self.max_new_tokens or (evaluator.max_new_tokens if evaluator else 64)
        prompts = self._prompts(trainer, evaluator)
        prompt_set = self.prompt_set or prompt_set_digest(prompts)
        comparable = (
            evaluator is not None
            and evaluator.tree == tree
            and evaluator.temperature == temperature
            and evaluator.max_new_tokens == max_new_tokens
            and evaluator._prompts(trainer) == prompts
        )
        tau = self._logged_tau(folder, evaluator) if comparable else None
        target = pl_module.target
        if tau is None and self.measure_if_missing:
            from lightning_spec.models.drafters.base import load_drafter

            measure = bench_measure(
                target,
                prompts,
                prompt_set=prompt_set,
                tree=tree,
                temperature=temperature,
                max_new_tokens=max_new_tokens,
            )
            tau = measure({"candidate": load_drafter(folder)}).get("candidate")
        tracking_uri, run_id = self._tracking(trainer)
        metadata = drafter_metadata(
            folder,
            taus={tau_key(prompt_set, temperature): tau} if tau is not None else None,
            objective=self.objective or type(pl_module).__name__,
            tree=tree,
            max_new_tokens=max_new_tokens,
            extra={"prompt_set": prompt_set, "num_prompts": len(prompts)},
        )
        self.version = register_drafter(
            folder,
            self.model_name,
            tracking_uri=tracking_uri,
            run_id=run_id,
            metadata=metadata,
            experiment_name=self.experiment_name,
        )
        self.decision = promote(
            self.model_name,
            self.version.version,
            prompt_set=prompt_set,
            temperature=temperature,
            tree=tree,
            margin=self.margin,
            max_new_tokens=max_new_tokens,
            tracking_uri=tracking_uri,
            run_id=run_id or self.version.run_id,
            target=target,
            prompts=prompts,
        )
        log.info("RegisterDrafter: %s", self.decision.summary())
        return self.decision
