"""`lightning-spec serve` on localhost: a real HTTP client, lossless answers, online updates
published as drafter folders after each round."""

from __future__ import annotations

import argparse
import socket
import threading
import time
from pathlib import Path

import pytest
import requests
import torch

from lightning_spec.decoding.engine import autoregressive_generate


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def server(tiny_cli_assets: dict[str, str], tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    import uvicorn

    from lightning_spec.cli.serve import build_server
    from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
    from lightning_spec.models.target import load_target
    from lightning_spec.online.http import make_app

    root = tmp_path_factory.mktemp("serve")
    target = load_target(tiny_cli_assets["model"])
    Eagle3Drafter.from_target(target).save_pretrained(root / "drafter")
    args = argparse.Namespace(
        target=tiny_cli_assets["model"], drafter=str(root / "drafter"), tree="dynamic:2,2,4",
        strategy="ogd", strategy_options='{"lr": 1e-3, "steps_per_round": 1}', round_size=2,
        out_dir=str(root / "out"), prepack=False, threads=1,
    )  # fmt: skip
    online = build_server(args)
    port = _free_port()
    config = uvicorn.Config(make_app(online), host="127.0.0.1", port=port, log_level="warning")
    http = uvicorn.Server(config)
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            if requests.get(f"{url}/health", timeout=1).ok:
                break
        except requests.ConnectionError:
            time.sleep(0.05)
    yield {"url": url, "online": online, "root": root}
    http.should_exit = True
    thread.join(timeout=10)


def test_completions_are_lossless_and_rounds_publish_drafters(server: dict) -> None:
    url, online = server["url"], server["online"]
    prompts = ["w5 w6 w7", "w9 w10", "w11 w12 w13 w14"]
    for prompt in prompts:
        response = requests.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 6},
                                 timeout=60)  # fmt: skip
        assert response.status_code == 200
        body = response.json()
        assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] >= 1
        ids = list(online.target.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        with torch.no_grad():
            expected = autoregressive_generate(online.target, ids, 6)
        text = online.target.tokenizer.decode(expected, skip_special_tokens=True)
        assert body["choices"][0]["text"] == text  # the target's own greedy answer
    stats = requests.get(f"{url}/v1/online", timeout=10).json()
    assert stats["requests"] == 3 and stats["updates"] == 1 and stats["pending"] == 1
    assert stats["update_seconds"] > 0 and stats["net_tokens_per_s"] <= stats["tokens_per_s"]
    latest = Path(server["root"]) / "out" / "drafters" / "latest"
    assert (latest / "model.safetensors").is_file() and (latest / "config.json").is_file()
    assert requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]


def test_bad_requests_get_a_clear_error(server: dict) -> None:
    url = server["url"]
    assert (
        requests.post(f"{url}/v1/completions", json={"prompt": ""}, timeout=10).status_code == 400
    )
    too_many = {"prompt": "w5", "max_tokens": 0}
    assert requests.post(f"{url}/v1/completions", json=too_many, timeout=10).status_code == 422
