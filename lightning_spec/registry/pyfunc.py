"""The MLflow pyfunc face of a registered drafter: prompts in, speculative completions out.

A registered drafter is logged with `mlflow.pyfunc.log_model` around `DrafterPyfunc`, so the
usual MLflow tools work on it (`mlflow.pyfunc.load_model("models:/NAME@champion")`,
`mlflow models serve`). A drafter is useless without its target, so `load_context` also loads
the target: the one named in the model config (`target`: a hub id, a model folder, `smollm2`),
by default the drafter config's `target_model`. Override it at load time:

    model = mlflow.pyfunc.load_model(uri, model_config={"target": "/models/SmolLM2-135M"})
    model.predict(pandas.DataFrame({"prompt": ["Hi!"]}), params={"max_new_tokens": 32})

Model config keys: `target`, `tree` (a tree policy spec), `dtype` (float32 / bf16),
`chat_template` (true: prompts are user messages rendered with the tokenizer's chat template;
false: raw text). This module imports mlflow at import time; the rest of `lightning_spec.registry`
imports it only when a drafter is registered.
"""

from __future__ import annotations

from importlib import metadata as importlib_metadata
from typing import Any

import mlflow.pyfunc

__all__ = ["DrafterPyfunc", "drafter_signature", "pip_requirements"]

DEFAULT_PARAMS: dict[str, Any] = {"max_new_tokens": 64, "temperature": 0.0, "seed": 0}


def drafter_signature() -> Any:
    """Input: a `prompt` string column; output: `completion` (string) and `tau` (double);
    params: max_new_tokens, temperature, seed."""
    from mlflow.models import ModelSignature
    from mlflow.types.schema import ColSpec, ParamSchema, ParamSpec, Schema

    return ModelSignature(
        inputs=Schema([ColSpec("string", "prompt")]),
        outputs=Schema([ColSpec("string", "completion"), ColSpec("double", "tau")]),
        params=ParamSchema(
            [
                ParamSpec("max_new_tokens", "long", DEFAULT_PARAMS["max_new_tokens"]),
                ParamSpec("temperature", "double", DEFAULT_PARAMS["temperature"]),
                ParamSpec("seed", "long", DEFAULT_PARAMS["seed"]),
            ]
        ),
    )


def _version(distribution: str) -> str | None:
    try:
        return importlib_metadata.version(distribution)
    except importlib_metadata.PackageNotFoundError:
        return None


def pip_requirements() -> list[str]:
    """What serving the model needs; explicit so MLflow does not spend ~10 s inferring it."""
    from lightning_spec import __version__

    requirements = [f"lightning-spec=={__version__}"]
    for name in ("torch", "transformers", "safetensors", "mlflow"):
        version = _version(name)
        # ">=" on the public version: a local tag such as +cpu names one wheel index only.
        requirements.append(f"{name}>={version.split('+')[0]}" if version else name)
    return requirements


class DrafterPyfunc(mlflow.pyfunc.PythonModel):
    """Speculative decoding with the registered drafter and its target (module docstring)."""

    # The signature is explicit; `predict` has no type hints on purpose (MLflow would read them
    # as a second schema). This MLflow attribute skips its type-hint wrapper and the warning
    # that the hints are missing.
    _skip_type_hint_validation = True

    def load_context(self, context: Any) -> None:
        import json
        from pathlib import Path

        from lightning_spec.decoding.build import parse_tree_spec
        from lightning_spec.models.drafters.base import CONFIG_NAME, load_drafter
        from lightning_spec.models.target import load_target

        config = dict(context.model_config or {})
        folder = Path(context.artifacts["drafter"])
        drafter_config = json.loads((folder / CONFIG_NAME).read_text())
        target_spec = config.get("target") or drafter_config.get("target_model")
        if not target_spec:
            raise ValueError(
                "the drafter config names no target_model: load with "
                "model_config={'target': <hub id or model folder>}"
            )
        self.target = load_target(str(target_spec), dtype=str(config.get("dtype", "float32")))
        self.drafter = load_drafter(folder, device=self.target.device).to(self.target.dtype)
        self.policy = parse_tree_spec(str(config.get("tree") or "chain:4"))
        self.chat_template = bool(config.get("chat_template", True))

    def _encode(self, prompt: str) -> list[int]:
        tokenizer = self.target.tokenizer
        if tokenizer is None:
            raise ValueError("the target has no tokenizer: cannot encode text prompts")
        if self.chat_template and getattr(tokenizer, "chat_template", None):
            from lightning_spec.data.chat import render_prompt

            return render_prompt(tokenizer, [{"role": "user", "content": prompt}])
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])

    def predict(self, context, model_input, params=None):  # noqa: ANN001, ANN201
        import pandas as pd
        import torch

        from lightning_spec.decoding.engine import SpeculativeDecoder

        options = {**DEFAULT_PARAMS, **(params or {})}
        if isinstance(model_input, pd.DataFrame):
            prompts = [str(p) for p in model_input["prompt"].tolist()]
        elif isinstance(model_input, str):
            prompts = [model_input]
        else:
            prompts = [str(p) for p in model_input]
        temperature = float(options["temperature"])
        decoder = SpeculativeDecoder(
            self.target, self.drafter, self.policy, temperature=temperature
        )
        completions, taus = [], []
        for index, prompt in enumerate(prompts):
            generator = torch.Generator(device=self.target.device)
            generator.manual_seed(int(options["seed"]) + index)
            result = decoder.generate(
                self._encode(prompt), int(options["max_new_tokens"]), generator=generator
            )
            text = self.target.tokenizer.decode(result.tokens, skip_special_tokens=True)
            completions.append(text.strip())
            taus.append(float(result.tau))
        return pd.DataFrame({"completion": completions, "tau": taus})
