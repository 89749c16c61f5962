"""Acceptance plots as PNG files and MLflow artifacts; the best drafter folder at fit end.

After every acceptance evaluation (`AcceptanceEval` in the same trainer) this callback draws
one figure with two panels: per-depth acceptance alpha_j of the first and the latest
evaluation (bars), and tau over training steps (line). The PNG is written under `dirpath` and,
when the trainer logs to MLflow, logged to the run under `plots/` (the same name each time, so
the run shows the latest). At the end of `fit` it also logs the `best/` folder of a
`DrafterCheckpoint` (or `last/` when no best exists) as the artifact folder `drafter/` (its
`training_state.json` says which and at what step), which is what the registry promotes. matplotlib (Agg backend) is imported only when drawing.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

log = logging.getLogger(__name__)

__all__ = ["AcceptancePlot", "draw_acceptance"]


def draw_acceptance(history: list[dict[str, Any]], path: str | Path) -> Path:
    """Draw the figure for an `AcceptanceEval.history` list into `path` (PNG)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure = Figure(figsize=(10, 4), dpi=100)
    bars, line = figure.subplots(1, 2)
    first, latest = history[0], history[-1]
    depths = list(range(1, len(latest["alpha"]) + 1))

    def clean(values: list[float]) -> list[float]:
        return [v if math.isfinite(v) else 0.0 for v in values]

    width = 0.4
    if len(history) > 1:
        bars.bar(
            [d - width / 2 for d in depths],
            clean(first["alpha"]),
            width,
            label=f"step {first['step']}",
        )
        bars.bar(
            [d + width / 2 for d in depths],
            clean(latest["alpha"]),
            width,
            label=f"step {latest['step']}",
        )
        bars.legend()
    else:
        bars.bar(depths, clean(latest["alpha"]), width * 2, label=f"step {latest['step']}")
    bars.set_xticks(depths)
    bars.set_ylim(0.0, 1.0)
    bars.set_xlabel("draft depth j")
    bars.set_ylabel("alpha_j = P(accept j | 1..j-1 accepted)")
    bars.set_title(f"per-depth acceptance ({latest.get('tree', '')})")
    steps = [entry["step"] for entry in history]
    taus = [entry["tau"] for entry in history]
    line.plot(steps, taus, marker="o")
    line.set_xlabel("global step")
    line.set_ylabel("tau (tokens per verification)")
    line.set_title(f"acceptance length, T={latest.get('temperature', 0.0)}")
    line.grid(True, alpha=0.3)
    figure.tight_layout()
    figure.savefig(path)
    return path


def _mlflow_loggers(trainer: Trainer) -> list[Any]:
    from lightning.pytorch.loggers import MLFlowLogger

    return [logger for logger in trainer.loggers if isinstance(logger, MLFlowLogger)]


class AcceptancePlot(Callback):
    """Plot `AcceptanceEval.history` after each evaluation; log plots and the best drafter."""

    def __init__(
        self,
        dirpath: str | None = None,
        filename: str = "acceptance.png",
        log_drafter: bool = True,
        drafter_artifact: str = "drafter",
    ) -> None:
        """
        Args:
            dirpath: Folder of the PNG; default `<trainer.default_root_dir>/plots`.
            filename: PNG file name (also the artifact name under `plots/`).
            log_drafter: At fit end, log the best (else last) drafter folder to MLflow.
            drafter_artifact: Artifact path of that folder in the run (`runs:/<id>/drafter`).
        """
        super().__init__()
        if not filename.endswith(".png"):
            raise ValueError(f"filename must end with .png, got {filename!r}")
        self.dirpath = dirpath
        self.filename = filename
        self.log_drafter = log_drafter
        self.drafter_artifact = drafter_artifact
        self._plotted = 0
        self.last_path: Path | None = None

    def _path(self, trainer: Trainer) -> Path:
        folder = Path(self.dirpath or Path(trainer.default_root_dir) / "plots").expanduser()
        return folder / self.filename

    @staticmethod
    def _find(trainer: Trainer, kind: type) -> Any | None:
        return next((c for c in trainer.callbacks if isinstance(c, kind)), None)

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        from lightning_spec.callbacks.acceptance import AcceptanceEval

        evaluator = self._find(trainer, AcceptanceEval)
        if evaluator is None or len(evaluator.history) <= self._plotted:
            return  # nothing new was measured in this validation pass
        self._plotted = len(evaluator.history)
        self.last_path = draw_acceptance(evaluator.history, self._path(trainer))
        from lightning_spec.tracking import safe_log_artifact

        for logger in _mlflow_loggers(trainer):  # never fails training (server gone: warns)
            safe_log_artifact(logger, self.last_path, "plots")

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.log_drafter or not trainer.is_global_zero:
            return
        from lightning_spec.callbacks.checkpoint import DrafterCheckpoint

        checkpoint = self._find(trainer, DrafterCheckpoint)
        if checkpoint is None:
            return
        for name in ("best", "last"):
            folder = checkpoint.root(trainer) / name
            if (folder / "config.json").is_file():
                from lightning_spec.tracking import safe_log_artifact

                for logger in _mlflow_loggers(trainer):
                    if safe_log_artifact(logger, folder, self.drafter_artifact):
                        log.info("logged drafter folder %s to MLflow", folder)
                return
