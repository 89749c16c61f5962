"""The MLflow model registry for drafters: metadata, registration, loading by alias.

A drafter folder (`Drafter.save_pretrained`) is logged as an MLflow pyfunc model
(`lightning_spec.registry_pyfunc.DrafterPyfunc`: prompts in, speculative completions out) with a
markdown model card, registered as a new version of a registered model, and described by
version tags (`drafter_metadata`): the target, its feature layers, the draft vocabulary, the tree
policy, tau per prompt set and temperature (`tau/<prompt set>/T<temperature>`), the training
objective and the git commit. `load_registered_drafter("models:/NAME@champion")` gives back a
`Drafter` for `SpeculativeDecoder`. Which version holds the `champion` alias is decided by
`lightning_spec.promotion.promote`; docs/registry.md describes the whole flow.

mlflow is imported inside the functions (~3-5 s): importing this module stays cheap.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "CARD_NAME",
    "CHALLENGER",
    "CHAMPION",
    "DEFAULT_EXPERIMENT",
    "MODEL_NAME_IN_RUN",
    "download_registered_drafter",
    "read_drafter_config",
    "resolve_version",
    "drafter_metadata",
    "load_registered_drafter",
    "metadata_tags",
    "model_card",
    "model_uri",
    "prompt_set_label",
    "register_drafter",
    "registry_client",
    "resolve_tracking_uri",
    "tau_key",
]

CHAMPION = "champion"
CHALLENGER = "challenger"
DEFAULT_EXPERIMENT = "lightning-spec-registry"
MODEL_NAME_IN_RUN = "drafter_model"
"""`name` of the logged model inside its run."""
CARD_NAME = "model_card.md"
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
    from lightning_spec.bench import git_commit

    folder = Path(drafter_dir)
    config = read_drafter_config(folder)
    drafter_type = config.get("drafter_type")
    if drafter_type is None and "LlamaForCausalLMEagle3" in config.get("architectures", []):
        drafter_type = "eagle3"
    layers = config.get("target_layer_ids")
    if layers is None:
        layers = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
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
        '(POST `{"inputs": [{"prompt": "..."}], "params": {"max_new_tokens": 64}}` to '
        "/invocations), or `mlflow.pyfunc.load_model(...)` with "
        "`model_config={'target': <model folder>}`. The drafter folder itself (config.json + "
        "model.safetensors) is under `artifacts/` of the model and loads with "
        "`lightning_spec.models.drafters.base.load_drafter`.",
        "",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- MLflow plumbing
def resolve_tracking_uri(tracking_uri: str | None = None) -> str:
    """`tracking_uri`, else `$MLFLOW_TRACKING_URI`, else `sqlite:////<cwd>/runs/mlflow.db` (the
    store `SpecMLFlowLogger` uses for runs under runs/)."""
    if tracking_uri:
        return tracking_uri
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    root = Path("runs").resolve()
    root.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{root / 'mlflow.db'}"


def registry_client(tracking_uri: str | None = None) -> Any:
    """An `MlflowClient` whose tracking and registry stores are both `tracking_uri`."""
    from mlflow.tracking import MlflowClient

    uri = resolve_tracking_uri(tracking_uri)
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _artifact_location(tracking_uri: str, experiment: str) -> str | None:
    """Beside a SQLite file: `<db folder>/mlartifacts/<experiment>`; a server decides itself."""
    from lightning_spec.tracking import default_artifact_location

    if not tracking_uri.startswith("sqlite:///"):
        return None
    db_path = Path(tracking_uri[len("sqlite:///") :]).resolve()
    return default_artifact_location(db_path, experiment, tracking_uri)


@contextlib.contextmanager
def _fluent_uris(tracking_uri: str) -> Iterator[None]:
    """Point MLflow's fluent API (used by `log_model`) at `tracking_uri`, then restore the
    previous module state *and* environment exactly (mlflow's own helper unsets the env)."""
    import mlflow
    from mlflow.tracking._model_registry import utils as registry_utils
    from mlflow.tracking._tracking_service import utils as tracking_utils

    saved_env = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
    saved = (tracking_utils._tracking_uri, registry_utils._registry_uri)
    mlflow.set_tracking_uri(tracking_uri)
    mlflow.set_registry_uri(tracking_uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(saved[0])
        registry_utils._registry_uri = saved[1]
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _ensure_run(client: Any, tracking_uri: str, experiment_name: str, run_name: str) -> str:
    experiment = client.get_experiment_by_name(experiment_name)
    if experiment is None or experiment.lifecycle_stage == "deleted":
        experiment_id = client.create_experiment(
            experiment_name, artifact_location=_artifact_location(tracking_uri, experiment_name)
        )
    else:
        experiment_id = experiment.experiment_id
    return client.create_run(experiment_id, run_name=run_name).info.run_id


@contextlib.contextmanager
def _resumed_run(client: Any, run_id: str, *, restore_status: bool) -> Iterator[None]:
    """Make `run_id` the active fluent run; a resumed run gets its status back afterwards
    (Lightning still owns a RUNNING training run at `on_fit_end`)."""
    import mlflow

    active = mlflow.active_run()
    if active is not None and active.info.run_id == run_id:
        yield
        return
    status = client.get_run(run_id).info.status
    try:
        with mlflow.start_run(run_id=run_id, nested=active is not None):
            yield
    finally:
        if restore_status and client.get_run(run_id).info.status != status:
            client.update_run(run_id, status=status)


def _create_registered_model(client: Any, model_name: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(
            model_name, description="Speculative-decoding drafters (lightning-spec)."
        )
    except MlflowException as error:
        if "ALREADY_EXISTS" not in str(error.error_code) and "already exists" not in str(error):
            raise


# Models from code: MLflow copies this file into the model and runs it at load time (no pickle).
_MODEL_CODE = """\
import mlflow.models

from lightning_spec.registry_pyfunc import DrafterPyfunc

mlflow.models.set_model(DrafterPyfunc())
"""


# ---------------------------------------------------------------------------------- register
def register_drafter(
    drafter_dir: str | Path,
    model_name: str,
    *,
    tracking_uri: str | None = None,
    run_id: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    experiment_name: str = DEFAULT_EXPERIMENT,
    model_config: Mapping[str, Any] | None = None,
) -> Any:
    """Log `drafter_dir` as a pyfunc model in run `run_id` (default: a new run in
    `experiment_name`), write the model card, register a new version of `model_name` with the
    metadata as tags, and return the `ModelVersion`.

    `metadata` defaults to `drafter_metadata(drafter_dir)` (no tau figures). `model_config` is
    the pyfunc default config (`target`, `tree`, `dtype`); loaders can override it.
    """
    import mlflow

    from lightning_spec.registry_pyfunc import drafter_signature, pip_requirements

    folder = Path(drafter_dir).expanduser().resolve()
    metadata = dict(metadata) if metadata is not None else drafter_metadata(folder)
    read_drafter_config(folder)
    uri = resolve_tracking_uri(tracking_uri)
    client = registry_client(uri)
    owned = run_id is None
    if owned:
        run_id = _ensure_run(client, uri, experiment_name, f"register-{model_name}")
    card = model_card(model_name, metadata)
    config = {"target": metadata.get("target_model"), "tree": metadata.get("tree") or "chain:4"}
    config = {**{k: v for k, v in config.items() if v}, "dtype": "float32", **(model_config or {})}
    with tempfile.TemporaryDirectory(prefix="lightning-spec-register-") as tmp:
        card_path = Path(tmp) / CARD_NAME
        card_path.write_text(card)
        code_path = Path(tmp) / "drafter_pyfunc.py"
        code_path.write_text(_MODEL_CODE)
        # The SQLite registry store looks logged models up through the fluent tracking URI, so
        # registration happens inside the same context as logging.
        with _fluent_uris(uri):
            with _resumed_run(client, run_id, restore_status=not owned), warnings.catch_warnings():
                # No input example on purpose: MLflow would load the model (and its target) to
                # check it.
                warnings.filterwarnings("ignore", message=".*input example.*", category=UserWarning)
                info = mlflow.pyfunc.log_model(
                    name=MODEL_NAME_IN_RUN,
                    python_model=str(code_path),
                    artifacts={"drafter": str(folder), "model_card": str(card_path)},
                    signature=drafter_signature(),
                    metadata=json.loads(json.dumps(metadata)),
                    model_config=config,
                    pip_requirements=pip_requirements(),
                )
            client.log_text(run_id, card, CARD_NAME)
            _create_registered_model(client, model_name)
            version = client.create_model_version(
                model_name,
                source=info.model_uri,
                run_id=run_id,
                tags=metadata_tags(metadata),
                description=card,
                model_id=getattr(info, "model_id", None),
            )
    if owned:
        client.set_terminated(run_id)
    return version


# ---------------------------------------------------------------------------------- load
def model_uri(name_or_uri: str, alias: str | None = None, version: str | int | None = None) -> str:
    """`models:/...` as given, else `models:/NAME@ALIAS` (default champion) or `models:/NAME/V`."""
    if name_or_uri.startswith("models:/"):
        if alias is not None or version is not None:
            raise ValueError("give a models:/ URI or a name with alias/version, not both")
        return name_or_uri
    if version is not None:
        return f"models:/{name_or_uri}/{version}"
    return f"models:/{name_or_uri}@{alias or CHAMPION}"


def resolve_version(client: Any, uri: str) -> Any:
    """`models:/NAME@ALIAS` or `models:/NAME/VERSION` -> the registry's ModelVersion."""
    from mlflow.exceptions import MlflowException

    path = uri[len("models:/") :]
    try:
        if "@" in path:
            name, alias = path.split("@", 1)
            return client.get_model_version_by_alias(name, alias)
        name, _, number = path.rpartition("/")
        if not name or not number.isdigit():
            raise ValueError(f"expected models:/NAME@ALIAS or models:/NAME/VERSION, got {uri!r}")
        return client.get_model_version(name, number)
    except MlflowException as error:
        raise LookupError(f"{uri}: {error.message}") from error


def download_registered_drafter(
    name_or_uri: str,
    alias: str | None = None,
    *,
    version: str | int | None = None,
    tracking_uri: str | None = None,
    dst_path: str | Path | None = None,
) -> Path:
    """Download a registered drafter model into `dst_path` (default: a new temp folder) and
    return its drafter folder (config.json + model.safetensors)."""
    import mlflow.artifacts
    from mlflow.models import Model

    uri = resolve_tracking_uri(tracking_uri)
    client = registry_client(uri)
    version_info = resolve_version(client, model_uri(name_or_uri, alias, version))
    source = client.get_model_version_download_uri(version_info.name, str(version_info.version))
    destination = Path(dst_path) if dst_path else Path(tempfile.mkdtemp(prefix="drafter-"))
    destination.mkdir(parents=True, exist_ok=True)
    # Some MLflow code paths resolve URIs through the fluent default store: point it at ours.
    with _fluent_uris(uri):
        local = Path(
            mlflow.artifacts.download_artifacts(
                artifact_uri=source, dst_path=str(destination), tracking_uri=uri
            )
        )
    flavor = Model.load(str(local / "MLmodel")).flavors.get("python_function", {})
    relative = ((flavor.get("artifacts") or {}).get("drafter") or {}).get("path")
    if relative is None:
        raise ValueError(f"{name_or_uri}: not a lightning-spec drafter model (no drafter artifact)")
    return local / relative


def load_registered_drafter(
    name_or_uri: str,
    alias: str | None = None,
    *,
    version: str | int | None = None,
    tracking_uri: str | None = None,
    device: Any = "cpu",
    dst_path: str | Path | None = None,
) -> Any:
    """`models:/NAME@champion` (or NAME + alias / version) -> a `Drafter` on `device`.

    Downloads to `dst_path` when given (kept), else to a temp folder removed after loading.
    """
    from lightning_spec.models.drafters.base import load_drafter

    temporary = dst_path is None
    destination = Path(tempfile.mkdtemp(prefix="drafter-")) if temporary else Path(dst_path)
    try:
        folder = download_registered_drafter(
            name_or_uri, alias, version=version, tracking_uri=tracking_uri, dst_path=destination
        )
        return load_drafter(folder, device=device)
    finally:
        if temporary:
            shutil.rmtree(destination, ignore_errors=True)


def __getattr__(name: str) -> Any:
    """`promote`, `Decision` and `bench_measure` live in `lightning_spec.promotion`."""
    if name in ("promote", "Decision", "bench_measure"):
        from lightning_spec import promotion

        return getattr(promotion, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
