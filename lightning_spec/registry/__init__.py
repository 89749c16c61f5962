"""The MLflow model registry for drafters: metadata, registration, loading by alias, promotion.

* `metadata`: what a registered drafter is and how well it drafts (version tags, model card);
  no MLflow.
* `register`: log a drafter folder as a pyfunc model, register a version, load one back
  (`load_registered_drafter("models:/NAME@champion")`).
* `pyfunc`: `DrafterPyfunc`, the MLflow face of a registered drafter (the only module here that
  imports mlflow at import time; nothing below imports it).
* `promotion`: the rule that moves the `champion` alias (`promote`).

docs/registry.md describes the whole flow. Importing this package stays cheap: mlflow (~3-5 s)
is imported inside the functions that talk to a store.
"""

from lightning_spec.registry.metadata import (
    TAU_PREFIX,
    drafter_metadata,
    metadata_tags,
    model_card,
    prompt_set_label,
    read_drafter_config,
    tau_key,
    temperature_label,
)
from lightning_spec.registry.promotion import (
    DEFAULT_MARGIN,
    Decision,
    Measure,
    alias_version,
    bench_measure,
    promote,
    stored_tau,
)
from lightning_spec.registry.register import (
    CARD_NAME,
    CHALLENGER,
    CHAMPION,
    DEFAULT_EXPERIMENT,
    MODEL_NAME_IN_RUN,
    download_registered_drafter,
    load_registered_drafter,
    model_uri,
    register_drafter,
    registry_client,
    resolve_tracking_uri,
    resolve_version,
)

__all__ = [
    "CARD_NAME",
    "CHALLENGER",
    "CHAMPION",
    "DEFAULT_EXPERIMENT",
    "DEFAULT_MARGIN",
    "Decision",
    "MODEL_NAME_IN_RUN",
    "Measure",
    "TAU_PREFIX",
    "alias_version",
    "bench_measure",
    "download_registered_drafter",
    "drafter_metadata",
    "load_registered_drafter",
    "metadata_tags",
    "model_card",
    "model_uri",
    "promote",
    "prompt_set_label",
    "read_drafter_config",
    "register_drafter",
    "registry_client",
    "resolve_tracking_uri",
    "resolve_version",
    "stored_tau",
    "tau_key",
    "temperature_label",
]
