"""Drafters: the interface (`base.Drafter`), its implementations, and loading a saved folder.

The arrows point one way: `base` imports none of the implementations, and each implementation
registers itself with `register_drafter` when imported. This file imports the built-in ones, so
`load_drafter` knows every built-in `drafter_type` however it is reached: importing any
submodule (`lightning_spec.models.drafters.base` included) runs this file first.
"""

from lightning_spec.models.drafters.base import (
    CONFIG_NAME,
    DRAFTER_TYPES,
    WEIGHTS_NAME,
    Drafter,
    DrafterOutput,
    load_drafter,
    register_drafter,
)
from lightning_spec.models.drafters.bigram import BigramDrafter
from lightning_spec.models.drafters.dflash import DFlashDrafter
from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
from lightning_spec.models.drafters.hydra import HydraDrafter
from lightning_spec.models.drafters.standalone import StandaloneDrafter

__all__ = [
    "CONFIG_NAME",
    "DRAFTER_TYPES",
    "WEIGHTS_NAME",
    "BigramDrafter",
    "DFlashDrafter",
    "Drafter",
    "DrafterOutput",
    "Eagle3Drafter",
    "HydraDrafter",
    "StandaloneDrafter",
    "load_drafter",
    "register_drafter",
]
