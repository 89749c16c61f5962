"""Target-layer ids in drafter folders, in each serving engine's numbering.

We number a target's feature layers as indices into Hugging Face's ``hidden_states`` (0 is the
embedding output, i is the output of decoder layer i - 1): that is what the drafter trained on.
The engines users deploy with read the ids from other keys and number them differently:

* vLLM's EAGLE-3 loader reads a top-level ``eagle_aux_hidden_state_layer_ids`` first, in our
  numbering;
* SGLang reads ``eagle_config.eagle_aux_hidden_state_layer_ids`` and adds 1 (its ids count
  decoder layers), so it must be given ours minus one;
* vLLM's newer model runner (DFlash and EAGLE-3) reads a top-level ``target_layer_ids`` and adds
  1, so that key also holds ours minus one.

`engine_layer_keys` writes all of them, plus ``feature_layers_hidden_states`` (ours, for our
own loader); `feature_layers_of` reads a folder's config back in our numbering, from whichever
keys it has (folders written before this convention carry ours in ``target_layer_ids``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["FEATURE_LAYERS_KEY", "engine_layer_keys", "feature_layers_of"]

FEATURE_LAYERS_KEY = "feature_layers_hidden_states"


def engine_layer_keys(ids: Sequence[int]) -> dict[str, Any]:
    """The config keys that give every engine the layers `ids` (our numbering)."""
    ours = [int(i) for i in ids]
    decoder = [i - 1 for i in ours]
    return {
        FEATURE_LAYERS_KEY: ours,
        "eagle_aux_hidden_state_layer_ids": ours,
        "target_layer_ids": decoder,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": decoder, "use_aux_hidden_state": True},
    }


def feature_layers_of(config: Mapping[str, Any]) -> list[int] | None:
    """A drafter config's feature layers in our numbering (None when it names none)."""
    if FEATURE_LAYERS_KEY in config:
        return [int(i) for i in config[FEATURE_LAYERS_KEY]]
    if "eagle_aux_hidden_state_layer_ids" in config:  # vLLM / speculators folders
        return [int(i) for i in config["eagle_aux_hidden_state_layer_ids"]]
    if "target_layer_ids" in config:  # folders written before this convention: ours
        return [int(i) for i in config["target_layer_ids"]]
    eagle = config.get("eagle_config") or {}
    if "eagle_aux_hidden_state_layer_ids" in eagle:  # an EAGLE-3 folder from elsewhere
        return [int(i) for i in eagle["eagle_aux_hidden_state_layer_ids"]]
    return None
