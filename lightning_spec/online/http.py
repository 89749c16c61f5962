"""`lightning-spec serve`: an HTTP completion endpoint that learns online from what it serves.

A small OpenAI-style subset on FastAPI (served by uvicorn): ``POST /v1/completions`` answers a
raw-text prompt with lossless speculative decoding (greedy at ``temperature: 0``, sampling that
preserves the target distribution above it), ``GET /v1/models`` names the model, ``GET
/v1/online`` reports what the online learner did, ``GET /health`` says it is up.

Every served request is feedback (`online.strategies`): after each `round_size` requests the
strategy updates the drafter from that round, while holding the model lock, so the update's time
is charged to serving (the next request waits; ``/v1/online`` reports the update seconds beside
the served tokens/s). After every update the drafter is written as a drafter folder (the EAGLE-3
layout SGLang and vLLM load) under ``out_dir/drafters/round-NNNN`` and ``out_dir/drafters/latest``
is replaced atomically, so an engine that hot-swaps drafter weights can pick it up.
"""

# No `from __future__ import annotations` here: FastAPI reads the request model of the route
# from its real annotation (a class defined inside `make_app`), not from a string.
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from lightning_spec.decoding.build import TreePolicy
from lightning_spec.decoding.engine import Generation, SpeculativeDecoder
from lightning_spec.online.strategies import OnlineStrategy

__all__ = ["OnlineServer", "make_app"]


class OnlineServer:
    """The model side of the endpoint: decode under one lock, learn every `round_size`."""

    def __init__(
        self,
        target: Any,
        strategy: OnlineStrategy,
        policy: TreePolicy,
        *,
        round_size: int = 25,
        out_dir: str | Path = "runs/serve",
        model_name: str = "lightning-spec",
        seed: int = 0,
    ) -> None:
        if round_size < 1:
            raise ValueError("round_size must be >= 1")
        self.target = target
        self.strategy = strategy
        self.policy = policy
        self.round_size = int(round_size)
        self.out_dir = Path(out_dir)
        self.model_name = model_name
        self.lock = threading.Lock()
        self.pending: list[Generation] = []
        self.generator = torch.Generator().manual_seed(seed)
        self.stats: dict[str, Any] = {"requests": 0, "tokens": 0, "serve_seconds": 0.0,
                                      "updates": 0, "update_seconds": 0.0, "last_update": None,
                                      "drafter_folder": None}  # fmt: skip

    def complete(self, prompt: str, max_tokens: int, temperature: float) -> dict[str, Any]:
        tokenizer = self.target.tokenizer
        ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        if not ids:
            raise ValueError("the prompt is empty after tokenization")
        with self.lock:
            decoder = SpeculativeDecoder(
                self.target, self.strategy.drafter, self.policy, temperature=temperature,
                keep_features=temperature == 0,
                keep_labels=self.strategy.label_top_k if temperature == 0 else 0,
            )  # fmt: skip
            result = decoder.generate(ids, max_tokens, generator=self.generator)
            self.stats["requests"] += 1
            self.stats["tokens"] += len(result.tokens)
            self.stats["serve_seconds"] += result.total_seconds
            if temperature == 0:  # T = 0 feedback: the committed tokens are the target's own
                self.pending.append(result)
            if len(self.pending) >= self.round_size:
                self._update()
        finish = "stop" if result.stopped_on_eos else "length"
        return {
            "id": f"cmpl-{uuid.uuid4().hex[:16]}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [
                {
                    "index": 0,
                    "text": tokenizer.decode(result.tokens, skip_special_tokens=True),
                    "finish_reason": finish,
                    "logprobs": None,
                }
            ],
            "usage": {
                "prompt_tokens": len(ids),
                "completion_tokens": len(result.tokens),
                "total_tokens": len(ids) + len(result.tokens),
            },
            "speculative": {"tau": result.tau, "verifications": result.num_verifications},
        }

    def _update(self) -> None:
        """Learn from the pending round (caller holds the lock) and publish the drafter."""
        from lightning_spec.io import atomic_folder

        round_ = self.pending
        self.pending = []
        tic = time.perf_counter()
        metrics = self.strategy.update(round_)
        index = self.stats["updates"]
        folder = self.out_dir / "drafters" / f"round-{index:04d}"
        self.strategy.drafter.save_pretrained(folder)
        with atomic_folder(self.out_dir / "drafters" / "latest") as tmp:
            self.strategy.drafter.save_pretrained(tmp)
        self.stats["updates"] += 1
        self.stats["update_seconds"] += time.perf_counter() - tic
        self.stats["last_update"] = {k: float(v) for k, v in metrics.items()}
        self.stats["drafter_folder"] = str(folder)

    def online_stats(self) -> dict[str, Any]:
        stats = dict(self.stats)
        serve = stats["serve_seconds"]
        stats["tokens_per_s"] = stats["tokens"] / serve if serve else None
        total = serve + stats["update_seconds"]
        stats["net_tokens_per_s"] = stats["tokens"] / total if total else None
        stats["strategy"] = self.strategy.name
        stats["pending"] = len(self.pending)
        return stats


def make_app(server: OnlineServer) -> Any:
    """The FastAPI application around `server`."""
    from fastapi import FastAPI, HTTPException
    from pydantic import BaseModel, Field

    class CompletionRequest(BaseModel):
        prompt: str
        max_tokens: int = Field(default=64, ge=1, le=4096)
        temperature: float = Field(default=0.0, ge=0.0)
        model: str | None = None

    app = FastAPI(title="lightning-spec", version="1")

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": server.model_name, "object": "model"}]}

    @app.get("/v1/online")
    def online() -> dict[str, Any]:
        return server.online_stats()

    @app.post("/v1/completions")
    def completions(request: CompletionRequest) -> dict[str, Any]:
        try:
            return server.complete(request.prompt, request.max_tokens, request.temperature)
        except ValueError as error:  # bad prompt, too long for the context: the client's error
            raise HTTPException(status_code=400, detail=str(error)) from error

    return app
