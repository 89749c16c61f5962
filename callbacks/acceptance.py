"""Acceptance evaluation at validation end: decode held-out prompts with the current drafter.

The number that matters for a drafter is tau, measured by the same `SpeculativeDecoder` that
serves it (docs/architecture.md), not a proxy loss. After each validation pass (every `every_n_val`
passes, never during the sanity check) this callback decodes held-out prompts and logs

* `val/tau`: committed tokens per target verification (accepted drafts + 1), pooled over steps;
* `val/alpha_1` .. `val/alpha_D`: per-depth acceptance, D = the tree policy's depth;
* `val/tokens_per_step`: new tokens per target forward with the prefill counted (plain
  autoregressive decoding scores 1.0), the proxy for the decoding speedup.

Prompts come from `trainer.datamodule.eval_prompts(n)` (token-id lists) or the `prompts` init
argument. Under DDP each rank decodes its share of the prompts and the metrics are summed over
ranks, so every rank logs the same values. With only 20 prompts this is a smoke signal, not a
benchmark (docs/benchmarking.md): `bench` reports intervals.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_spec.metrics import AcceptanceLength, PerDepthAcceptance

log = logging.getLogger(__name__)

__all__ = ["AcceptanceEval"]


class AcceptanceEval(Callback):
    """Decode held-out prompts at validation end and log tau, alpha_j and tokens per step."""

    def __init__(
        self,
        num_prompts: int = 20,
        max_new_tokens: int = 64,
        tree: str = "chain:4",
        temperature: float = 0.0,
        every_n_val: int = 1,
        prompts: list[list[int]] | None = None,
        seed: int = 0,
    ) -> None:
        """
        Args:
            num_prompts: Held-out prompts decoded per evaluation.
            max_new_tokens: New tokens per prompt.
            tree: Tree policy spec (`chain:K`, `dynamic:DEPTH,TOP_K,TOTAL`, `static:NAME`).
            temperature: 0 for greedy verification; > 0 samples (lossless rejection sampling).
            every_n_val: Evaluate on every n-th validation pass.
            prompts: Token-id prompts to use when the datamodule has no `eval_prompts(n)`.
            seed: Seed of the sampling generator when temperature > 0.
        """
        super().__init__()
        from lightning_spec.decoding.build import parse_tree_spec

        if num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if every_n_val < 1:
            raise ValueError(f"every_n_val must be >= 1, got {every_n_val}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        self.policy = parse_tree_spec(tree)  # fails here, not after an epoch, on a bad spec
        self.num_prompts = num_prompts
        self.max_new_tokens = max_new_tokens
        self.tree = tree
        self.temperature = float(temperature)
        self.every_n_val = every_n_val
        self.prompts = [list(map(int, p)) for p in prompts] if prompts is not None else None
        self.seed = seed
        self.max_depth = int(self.policy.max_depth)
        self.history: list[dict[str, Any]] = []
        self._validations = 0
        self._eval_prompts: list[list[int]] | None = None

    # ---------------------------------------------------------------------------- prompts
    def _prompts(self, trainer: Trainer) -> list[list[int]]:
        if self._eval_prompts is None:
            datamodule = getattr(trainer, "datamodule", None)
            if self.prompts is not None:
                prompts = self.prompts[: self.num_prompts]
            elif datamodule is not None and hasattr(datamodule, "eval_prompts"):
                prompts = [list(map(int, p)) for p in datamodule.eval_prompts(self.num_prompts)]
            else:
                raise ValueError(
                    "AcceptanceEval needs prompts: give the datamodule an eval_prompts(n) method "
                    "or pass prompts=[[token ids], ...]"
                )
            if not prompts or any(len(p) == 0 for p in prompts):
                raise ValueError("AcceptanceEval got no prompts or an empty prompt")
            self._eval_prompts = prompts
        return self._eval_prompts

    # ---------------------------------------------------------------------------- evaluation
    def evaluate(self, pl_module: LightningModule, prompts: list[list[int]]) -> dict[str, Any]:
        """Decode `prompts` with `pl_module.target` / `pl_module.drafter`; return local sums.

        Public so benches and tests can run the same measurement outside a Trainer.
        """
        from lightning_spec.decoding.engine import SpeculativeDecoder

        target, drafter = pl_module.target, pl_module.drafter
        device = pl_module.device
        tau = AcceptanceLength().to(device)
        alpha = PerDepthAcceptance(self.max_depth).to(device)
        decoder = SpeculativeDecoder(target, drafter, self.policy, temperature=self.temperature)
        generator = None
        if self.temperature > 0:
            generator = torch.Generator(device=target.device).manual_seed(self.seed)
        was_training = drafter.training
        drafter.eval()
        new_tokens, forwards, per_prompt = 0, 0, []
        try:
            with torch.no_grad():
                for prompt in prompts:
                    generation = decoder.generate(prompt, self.max_new_tokens, generator=generator)
                    tau.update_from_records(generation.records)
                    alpha.update_from_records(generation.records)
                    new_tokens += len(generation.tokens)
                    forwards += generation.num_verifications + 1  # + the prefill
                    per_prompt.append(generation.tau)
        finally:
            drafter.train(was_training)
        return {
            "tau": tau,
            "alpha": alpha,
            "new_tokens": new_tokens,
            "forwards": forwards,
            "per_prompt_tau": per_prompt,
        }

    @override
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking:
            return
        self._validations += 1
        if (self._validations - 1) % self.every_n_val:
            return
        prompts = self._prompts(trainer)
        # Each rank decodes its share; the metrics' sum states are reduced in compute().
        shard = prompts[trainer.global_rank :: max(1, trainer.world_size)]
        result = self.evaluate(pl_module, shard)
        tau = float(result["tau"].compute())
        alphas = [float(a) for a in result["alpha"].compute()]
        counts = torch.tensor(
            [result["new_tokens"], result["forwards"]], dtype=torch.float64, device=pl_module.device
        )
        counts = trainer.strategy.reduce(counts, reduce_op="sum")
        tokens_per_step = float(counts[0] / counts[1]) if counts[1] > 0 else float("nan")
        metrics = {"val/tau": tau, "val/tokens_per_step": tokens_per_step}
        for depth, value in enumerate(alphas, start=1):
            metrics[f"val/alpha_{depth}"] = value  # NaN: depth never reached
        for key, value in metrics.items():
            pl_module.log(key, value, sync_dist=False)
        self.history.append(
            {
                "step": int(trainer.global_step),
                "epoch": int(trainer.current_epoch),
                "tau": tau,
                "alpha": alphas,
                "tokens_per_step": tokens_per_step,
                "per_prompt_tau": result["per_prompt_tau"],  # this rank's prompts only
                "tree": self.tree,
                "temperature": self.temperature,
            }
        )
        log.info("acceptance eval at step %d: tau %.3f (%s)", trainer.global_step, tau, self.tree)

    # ---------------------------------------------------------------------------- resume
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history, "validations": self._validations}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = list(state_dict.get("history", []))
        self._validations = int(state_dict.get("validations", 0))
