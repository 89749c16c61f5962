"""The one interface every drafter offers to training and to the decoder.

Training and inference must run the same code (docs/architecture.md), so a drafter has a single
incremental `step` over explicit positions and an optional boolean mask; teacher-forced
`forward` is `step` on a fresh state. Logits come in the drafter's own vocabulary; `to_target`
maps log-probs onto the target's vocabulary for verification.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from lightning_spec.models.drafters.proposer import DrafterProposer

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


@dataclass
class DrafterOutput:
    logits: Tensor  # [B, T, V_draft]
    hidden: Tensor  # [B, T, H] the drafter's own pre-norm hidden state (EAGLE feeds it back)


class Drafter(nn.Module):
    """Base class: subclasses implement `new_state`, `step`, `state_length`, `truncate_state`."""

    drafter_type: ClassVar[str] = "base"
    #: True when `step` needs target features for committed tokens (EAGLE-style heads).
    needs_features: ClassVar[bool] = False
    #: True for block drafters (DFlash): one forward drafts every depth; trained by block SFT.
    drafts_blocks: ClassVar[bool] = False

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.config = dict(config)

    # --- the incremental interface -------------------------------------------------------
    def new_state(self, batch_size: int = 1) -> Any:
        raise NotImplementedError

    def state_length(self, state: Any) -> int:
        raise NotImplementedError

    def truncate_state(self, state: Any, length: int) -> None:
        raise NotImplementedError

    def keep_state_entries(self, state: Any, drop_last: int, keep: Tensor | list[int]) -> None:
        """Drop the last `drop_last` positions except the offsets in `keep` (see models.cache)."""
        raise NotImplementedError

    def step(
        self,
        state: Any,
        input_ids: Tensor,
        position_ids: Tensor,
        *,
        features: Tensor | None = None,
        hidden: Tensor | None = None,
        mask: Tensor | None = None,
    ) -> DrafterOutput:
        """Append `input_ids` [B, T] at `position_ids` [B, T] to `state` and return their logits.

        `mask` is bool [B|1, T, past + T] (True = attend); None means causal over the new
        tokens and full attention to the past. EAGLE drafters take either the target's fused
        `features` [B, T, F] or their own `hidden` [B, T, H] for the token before each input.
        """
        raise NotImplementedError

    def draft_step(
        self,
        state: Any,
        input_ids: Tensor,
        position_ids: Tensor,
        *,
        depth: Tensor,
        hidden: Tensor | None = None,
        mask: Tensor | None = None,
    ) -> DrafterOutput:
        """`step` for draft-tree nodes at draft `depth` [B, T] (1 = children of the root).

        The default ignores the depth (EAGLE heads and small LMs draft every depth alike); a
        drafter with one head per depth (Hydra) or block slots (DFlash) reads it here.
        """
        del depth
        return self.step(state, input_ids, position_ids, hidden=hidden, mask=mask)

    drafts_from_sequence: bool = True
    """Whether `sequence_proposer` can root B trees in one teacher-forced sequence (the seam
    replay, GTO and Draft-OPD use)."""

    def bind_target(self, target: Any) -> None:
        """Attach weights shared with the frozen `target` (DFlash shares its embeddings and LM
        head); a no-op for self-contained drafters. The decoder and the objectives call it."""
        del target

    def proposer(
        self,
        state: Any,
        root_logits: Tensor,
        root_hidden: Tensor,
        root_positions: Tensor,
        *,
        temperature: float = 0.0,
        context_lengths: Tensor | None = None,
    ) -> DrafterProposer:
        """The drafting seam the decoder and the objectives use (see `DrafterProposer`);
        override to feed tree nodes another way."""
        from lightning_spec.models.drafters.proposer import DrafterProposer

        return DrafterProposer(
            self,
            state,
            root_logits,
            root_hidden,
            root_positions,
            temperature=temperature,
            context_lengths=context_lengths,
        )

    def sequence_proposer(
        self,
        input_ids: Tensor,
        root_positions: Tensor,
        *,
        features: Tensor | None = None,
        temperature: float = 0.0,
    ) -> Any:
        """B trees rooted at `root_positions` [B] of one teacher-forced sequence [1, L]: the
        seam GTO and Draft-OPD draft and re-score through (`DrafterProposer.from_sequence`);
        drafters with their own proposer override it."""
        from lightning_spec.models.drafters.proposer import DrafterProposer

        return DrafterProposer.from_sequence(
            self, input_ids, root_positions, features=features, temperature=temperature
        )

    def forward(
        self,
        input_ids: Tensor,
        features: Tensor | None = None,
        *,
        hidden: Tensor | None = None,
        position_ids: Tensor | None = None,
        mask: Tensor | None = None,
    ) -> DrafterOutput:
        """Teacher-forced pass over whole sequences: `step` on a fresh state."""
        batch, length = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(length, device=input_ids.device).expand(batch, -1)
        state = self.new_state(batch)
        return self.step(
            state, input_ids, position_ids, features=features, hidden=hidden, mask=mask
        )

    # --- vocabulary ----------------------------------------------------------------------
    @property
    def target_vocab_size(self) -> int:
        return int(self.config["target_vocab_size"])

    def to_target(self, logprobs: Tensor) -> Tensor:
        """Draft-vocabulary log-probs [..., V_draft] -> target vocabulary [..., V] (-inf off-vocab)."""
        return logprobs

    def target_to_draft_ids(self, target_ids: Tensor) -> Tensor:
        """Target ids -> draft ids (-1 where the token is outside the draft vocabulary)."""
        return target_ids

    # --- persistence ---------------------------------------------------------------------
    def save_pretrained(self, folder: str | Path) -> Path:
        """config.json + model.safetensors, each written atomically (`lightning_spec.io`); the
        weights go first, so a config never names weights that are not complete."""
        from safetensors.torch import save_file

        from lightning_spec.io import atomic_path, atomic_write_text

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        config = {"drafter_type": self.drafter_type, **self.export_config()}
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.export_state_dict().items()}
        with atomic_path(folder / WEIGHTS_NAME) as tmp_weights:
            save_file(tensors, str(tmp_weights), metadata={"format": "pt"})
        atomic_write_text(folder / CONFIG_NAME, json.dumps(config, indent=2, sort_keys=True))
        return folder

    def export_config(self) -> dict[str, Any]:
        return dict(self.config)

    def export_state_dict(self) -> dict[str, Tensor]:
        return self.state_dict()

    @classmethod
    def from_config_dict(cls, config: dict[str, Any]) -> Drafter:
        return cls(config)

    def load_exported_state_dict(self, tensors: dict[str, Tensor]) -> None:
        self.load_state_dict(tensors)


DRAFTER_TYPES: dict[str, type[Drafter]] = {}


def register_drafter(cls: type[Drafter]) -> type[Drafter]:
    """Record a drafter class under its `drafter_type` so folders reload without guessing."""
    DRAFTER_TYPES[cls.drafter_type] = cls
    return cls


def drafter_type_of(config: dict[str, Any]) -> str | None:
    """A drafter folder config's type: its ``drafter_type``, or ``eagle3``/``dflash`` for a
    folder written elsewhere (the architecture names SGLang, vLLM and the DFlash reference use);
    None when it names neither."""
    drafter_type = config.get("drafter_type")
    architectures = config.get("architectures", [])
    if drafter_type is None and "LlamaForCausalLMEagle3" in architectures:
        drafter_type = "eagle3"
    if drafter_type is None and "DFlashDraftModel" in architectures:
        drafter_type = "dflash"
    return drafter_type


def load_drafter(
    folder: str | Path, *, device: str | torch.device = "cpu", target: Any = None
) -> Drafter:
    """Load any drafter folder written by `save_pretrained`; with `target`, bind the weights it
    shares with that target (embeddings, a DFlash LM head), which the folder does not hold.

    Looks the folder's `drafter_type` up in `DRAFTER_TYPES`. This module imports none of the
    implementations (they import it); the package's `__init__` imports the built-in ones, and
    Python runs it before any submodule, so they are registered whichever way this function
    was imported.
    """
    from safetensors.torch import load_file

    folder = Path(folder)
    config_path = folder / CONFIG_NAME
    if not config_path.is_file():
        raise FileNotFoundError(f"{folder} is not a drafter folder: {CONFIG_NAME} is missing")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{config_path} is not valid JSON: {error}") from error
    drafter_type = drafter_type_of(config)
    if drafter_type not in DRAFTER_TYPES:
        raise ValueError(
            f"{config_path}: unknown drafter_type {drafter_type!r}; known: {sorted(DRAFTER_TYPES)}"
        )
    weights = folder / WEIGHTS_NAME
    if not weights.is_file():
        raise FileNotFoundError(f"{folder}: {WEIGHTS_NAME} is missing")
    drafter = DRAFTER_TYPES[drafter_type].from_config_dict(config)
    drafter.load_exported_state_dict(load_file(str(weights)))
    drafter = drafter.to(device).eval()
    if target is not None:
        drafter.bind_target(target)
    return drafter
