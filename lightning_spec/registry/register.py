"""Registration and loading: a drafter folder in, a registered model version out, and back.

A drafter folder (`Drafter.save_pretrained`) is logged as an MLflow pyfunc model
(`lightning_spec.registry.pyfunc.DrafterPyfunc`: prompts in, speculative completions out) with
a markdown model card, registered as a new version of a registered model, and described by
version tags (`drafter_metadata`, in `lightning_spec.registry.metadata`): the target, its
feature layers, the draft vocabulary, the tree policy, tau per prompt set and temperature
(`tau/<prompt set>/T<temperature>`), the training objective and the git commit.
`load_registered_drafter("models:/NAME@champion")` gives back a `Drafter` for
`SpeculativeDecoder`. Which version holds the `champion` alias is decided by
`lightning_spec.registry.promotion.promote`; docs/registry.md describes the whole flow.

mlflow is imported inside the functions (~3-5 s): importing this module stays cheap.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from lightning_spec.registry.metadata import (
    drafter_metadata,
    metadata_tags,
    model_card,
    read_drafter_config,
)

__all__ = [
    "CARD_NAME",
    "CHALLENGER",
    "CHAMPION",
    "DEFAULT_EXPERIMENT",
    "MODEL_NAME_IN_RUN",
    "download_registered_drafter",
    "load_registered_drafter",
    "model_uri",
    "register_drafter",
    "registry_client",
    "resolve_tracking_uri",
    "resolve_version",
]

CHAMPION = "champion"
CHALLENGER = "challenger"
DEFAULT_EXPERIMENT = "lightning-spec-registry"
MODEL_NAME_IN_RUN = "drafter_model"
"""`name` of the logged model inside its run."""
CARD_NAME = "model_card.md"


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

from lightning_spec.registry.pyfunc import DrafterPyfunc

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

    from lightning_spec.registry.pyfunc import drafter_signature, pip_requirements

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
