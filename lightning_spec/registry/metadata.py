"""Registry metadata: what a registered drafter is and how well it drafts.

Keys, version tags and the model card (docs/registry.md, "Metadata"). No MLflow here: the
metadata is computed before anything talks to a store, and tests read it without one.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_spec.models.layer_ids import feature_layers_of

__all__ = [
    "TAU_PREFIX",
    "drafter_metadata",
    "metadata_tags",
    "model_card",
    "prompt_set_label",
    "read_drafter_config",
    "tau_key",
    "temperature_label",
]

TAU_PREFIX = "tau/"


# ---------------------------------------------------------------------------------- keys
def temperature_label(temperature: float) -> str:
    """0 -> "T0", 0.7 -> "T0.7" (MLflow keys allow letters, digits, `_-./ :`)."""
    return f"T{float(temperature):g}"


def tau_key(prompt_set: str, temperature: float) -> str:
    """The metadata key of tau measured on `prompt_set` at `temperature`: `tau/mtbench/T0`."""
    if not prompt_set or "/" in prompt_set:
        raise ValueError(f"a prompt set label must be non-empty without '/': {prompt_set!r}")
    return f"{TAU_PREFIX}{prompt_set}/{temperature_label(temperature)}"


def prompt_set_label(dataset: str, limit: int | None = None, selection: str = "stratified") -> str:
    """A label naming a prompt set exactly: `mtbench` (all), `mtbench-20` (20, stratified),
    `mtbench-first20` (the first 20). Figures are comparable only under the same label."""
    name = Path(dataset).name.split(".")[0] if ("/" in dataset or "." in dataset) else dataset
    name = re.sub(r"[^a-z0-9_-]+", "-", name.strip().lower()).strip("-") or "prompts"
    if limit is None:
        return name
    return f"{name}-{'first' if selection == 'first' else ''}{int(limit)}"


# ---------------------------------------------------------------------------------- metadata
def read_drafter_config(drafter_dir: Path) -> dict[str, Any]:
    from lightning_spec.models.drafters.base import CONFIG_NAME, WEIGHTS_NAME

    if not drafter_dir.is_dir():
        raise FileNotFoundError(f"drafter folder not found: {drafter_dir}")
    config_path = drafter_dir / CONFIG_NAME
    if not config_path.is_file():
        raise FileNotFoundError(f"{drafter_dir} is not a drafter folder: {CONFIG_NAME} is missing")
    if not (drafter_dir / WEIGHTS_NAME).is_file():
        raise FileNotFoundError(f"{drafter_dir} is not a drafter folder: {WEIGHTS_NAME} is missing")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{config_path} is not valid JSON: {error}") from error
    if not isinstance(config, dict):
        raise ValueError(f"{config_path} does not hold a JSON object")
    return config


def drafter_metadata(
    drafter_dir: str | Path,
    *,
    taus: Mapping[Any, float] | None = None,
    objective: str | None = None,
    tree: str | None = None,
    max_new_tokens: int | None = None,
    target: str | None = None,
    commit: str | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """What a registered drafter is and how well it drafts, as a flat dict.

    Keys: `drafter_type`, `target_model` (`target` wins over the config's), `target_layer_ids`,
    `draft_vocab_size`, `target_vocab_size`, `tree`, `max_new_tokens` (of the tau
    measurements), `tau/<prompt set>/T<temperature>` for each entry of `taus` (keys given
    either whole, `"tau/mtbench/T0"`, or as `(prompt_set, temperature)` pairs), `objective`,
    `git_commit` (default: this repository's HEAD), `training_step` (from training_state.json),
    plus `extra`. None values are left out.
    """
    from lightning_spec.bench.machine import git_commit

    folder = Path(drafter_dir)
    config = read_drafter_config(folder)
    drafter_type = config.get("drafter_type")
    if drafter_type is None and "LlamaForCausalLMEagle3" in config.get("architectures", []):
        drafter_type = "eagle3"
    layers = feature_layers_of(config)  # in our numbering, whichever keys the folder has
    target_vocab = config.get("target_vocab_size", config.get("vocab_size"))
    metadata: dict[str, Any] = {
        "drafter_type": drafter_type,
        "target_model": target or config.get("target_model") or None,
        "target_layer_ids": [int(x) for x in layers] if layers is not None else None,
        "draft_vocab_size": int(config.get("draft_vocab_size") or target_vocab or 0) or None,
        "target_vocab_size": int(target_vocab) if target_vocab is not None else None,
        "tree": tree,
        "max_new_tokens": int(max_new_tokens) if max_new_tokens is not None else None,
        "objective": objective,
        "git_commit": commit or git_commit(),
    }
    state_path = folder / "training_state.json"
    if state_path.is_file():
        with contextlib.suppress(ValueError, OSError):
            metadata["training_step"] = json.loads(state_path.read_text()).get("global_step")
    for key, value in (taus or {}).items():
        name = key if isinstance(key, str) else tau_key(str(key[0]), float(key[1]))
        if not name.startswith(TAU_PREFIX):
            raise ValueError(f"tau keys look like 'tau/<prompt set>/T<temperature>', got {name!r}")
        if value is not None and math.isfinite(float(value)):
            metadata[name] = round(float(value), 6)
    metadata.update(extra or {})
    return {k: v for k, v in metadata.items() if v is not None}


def metadata_tags(metadata: Mapping[str, Any]) -> dict[str, str]:
    """Model version tags are strings: lists and dicts as JSON, numbers as written."""
    tags = {}
    for key, value in metadata.items():
        if value is None:
            continue
        tags[key] = json.dumps(value) if isinstance(value, (list, tuple, dict)) else str(value)
    return tags


def model_card(model_name: str, metadata: Mapping[str, Any]) -> str:
    """A short markdown card: what the drafter is, for which target, how well, how to use it."""
    taus = {k: v for k, v in metadata.items() if k.startswith(TAU_PREFIX)}
    tau_lines = [
        f"| {key.split('/')[1]} | {key.split('/')[2][1:]} | {value:.3f} |"
        for key, value in sorted(taus.items())
    ]
    target = metadata.get("target_model", "unknown")
    lines = [
        f"# {model_name}: a {metadata.get('drafter_type', '?')} drafter",
        "",
        f"A speculative-decoding drafter for the target `{target}`, trained with objective "
        f"`{metadata.get('objective', 'unknown')}` (commit `{metadata.get('git_commit', '?')}`). "
        "Verification keeps decoding lossless: the target's own output is unchanged, the drafter "
        "only decides how many tokens each target forward commits.",
        "",
        f"- target feature layers: {metadata.get('target_layer_ids', 'none (standalone)')}",
        f"- draft vocabulary: {metadata.get('draft_vocab_size', '?')} of "
        f"{metadata.get('target_vocab_size', '?')} target tokens",
        f"- tree policy of the figures: `{metadata.get('tree', 'unknown')}`, max new tokens "
        f"{metadata.get('max_new_tokens', '?')}",
        "",
        "## Acceptance (tau = tokens committed per target verification)",
        "",
    ]
    if tau_lines:
        lines += ["| prompt set | temperature | tau |", "|---|---|---|", *tau_lines]
    else:
        lines.append("Not measured at registration.")
    lines += [
        "",
        "## Use",
        "",
        "```python",
        "from lightning_spec.registry import load_registered_drafter",
        "from lightning_spec.decoding.engine import SpeculativeDecoder",
        "from lightning_spec.decoding.build import parse_tree_spec",
        "from lightning_spec.models.target import load_target",
        "",
        f'drafter = load_registered_drafter("models:/{model_name}@champion")',
        f'target = load_target("{target}")',
        f'decoder = SpeculativeDecoder(target, drafter, parse_tree_spec("{metadata.get("tree") or "chain:4"}"))',
        "```",
        "",
        f"Serve: `mlflow models serve -m models:/{model_name}@champion --env-manager local` "
        '(POST `{"dataframe_records": [{"prompt": "..."}], "params": {"max_new_tokens": 64}}` to '
        "/invocations), or `mlflow.pyfunc.load_model(...)` with "
        "`model_config={'target': <model folder>}`. The drafter folder itself (config.json + "
        "model.safetensors) is under `artifacts/` of the model and loads with "
        "`lightning_spec.models.drafters.base.load_drafter`.",
        "",
    ]
    return "\n".join(lines)
