"""The real ``vllm serve`` (the cached CPU build) with our drafter and plugin, over HTTP: replies
are the target's greedy text, the features captured from the serving pass equal a separate
target prefill's, a push changes the served drafter while a bad one is refused, and malformed or
oversized requests get a 4xx and reach no learner. Slow: the
real SmolLM2 and vLLM's start-up; skipped where vLLM-CPU is not installed
(`./scripts/build_vllm.sh`)."""

from __future__ import annotations

import json
import shutil
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from pathlib import Path

import pytest
import torch

from tests.conftest import noisy_copy

pytestmark = pytest.mark.slow

NEW_TOKENS = 32


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _complete(url: str, prompt: list[int]) -> list[int]:
    body = {"model": "x", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
            "return_token_ids": True}  # fmt: skip
    request = urllib.request.Request(url + "/v1/models")
    with urllib.request.urlopen(request, timeout=30) as answer:
        body["model"] = json.loads(answer.read())["data"][0]["id"]
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=600) as answer:
        reply = json.loads(answer.read())
    return [int(t) for t in reply["choices"][0]["token_ids"]]


def test_vllm_serve_captures_features_and_takes_pushes(
    tmp_path: Path, engine_drafter, vllm_env
) -> None:  # noqa: ANN001
    from lightning_spec.data.assets import default_target_path
    from lightning_spec.decoding.engine import autoregressive_generate
    from lightning_spec.io import sha256_file
    from lightning_spec.online.spool import SpoolReader
    from lightning_spec.online.vllm_server import VllmServer, serve_command

    env = vllm_env
    fitted = engine_drafter(NEW_TOKENS)
    target, prompts = fitted["target"], fitted["prompts"]
    learner = tmp_path / "learner" / "drafters"
    fitted["drafter"].save_pretrained(learner / "a")
    noisy_copy(learner / "a", learner / "noisy")
    shutil.copytree(learner / "a", tmp_path / "outside")
    greedy = [autoregressive_generate(target, p, NEW_TOKENS, stop_on_eos=True) for p in prompts]
    command = serve_command(env, default_target_path(), learner / "a", k=3, port=_free_port())
    with closing(VllmServer(env, command, log=tmp_path / "vllm.log", workdir=tmp_path,
                    spool=tmp_path / "spool", push_root=tmp_path / "learner")) as server:  # fmt: skip
        start = server.get("/lightning-spec/status")
        assert start["capture"]["enabled"], start
        with ThreadPoolExecutor(4) as pool:  # four clients at once
            replies = list(pool.map(lambda p: _complete(server.url, p), prompts))
        assert replies == [g[: len(r)] for g, r in zip(greedy, replies, strict=True)]
        deadline = time.monotonic() + 60
        while (
            len(SpoolReader(tmp_path / "spool").pending()) < len(prompts)
            and time.monotonic() < deadline
        ):
            time.sleep(0.5)
        captured = [e.request for e in SpoolReader(tmp_path / "spool").take()]
        assert len(captured) == len(prompts), server.get("/lightning-spec/status")
        worst = 0.0
        for request in captured:
            prompt = request.token_ids[: request.prompt_len]
            index = prompts.index(prompt)
            assert request.answer[: len(replies[index])] == replies[index]
            with torch.no_grad():
                out = target(torch.tensor([request.computed]), use_cache=False)
            error = (request.aux - out.features[0]).norm() / out.features[0].norm()
            worst = max(worst, float(error))
        print(f"captured features against a separate prefill: max relative error {worst:.2e}")
        assert worst < 1e-4

        sha = sha256_file(learner / "noisy" / "model.safetensors")
        status, answer = server.post(
            "/lightning-spec/push", {"folder": str(learner / "noisy"), "sha256": sha}
        )
        assert status == 200 and answer["served_sha256"] == sha
        assert server.get("/lightning-spec/status")["served_sha256"] == sha
        refused = [
            ({"folder": str(tmp_path / "outside"), "sha256": sha}, 403),
            ({"folder": str(learner / "a"), "sha256": "0" * 64}, 409),
        ]
        for body, code in refused:
            assert server.post("/lightning-spec/push", body)[0] == code
        assert server.get("/lightning-spec/status")["served_sha256"] == sha  # unchanged
        again = [_complete(server.url, p) for p in prompts]
        assert again == replies  # lossless with the pushed drafter

        # malformed and oversized requests: the server's 4xx, nothing reaches the spool
        finished = server.get("/lightning-spec/status")["capture"]["capture_finished"]
        model = server.get("/v1/models")["data"][0]["id"]
        bad = [
            b"{not json",
            json.dumps({"model": model, "prompt": [5] * 4000, "max_tokens": 8}).encode(),
            json.dumps({"model": model, "prompt": prompts[0], "max_tokens": -3}).encode(),
        ]
        for body in bad:
            request = urllib.request.Request(server.url + "/v1/completions", data=body,
                                             headers={"content-type": "application/json"})  # fmt: skip
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=60)
            assert 400 <= refused.value.code < 500
        time.sleep(2)
        assert server.get("/lightning-spec/status")["capture"]["capture_finished"] == finished


def test_serve_learn_pushes_what_it_learned_and_replies_stay_greedy(
    tmp_path: Path, engine_drafter
) -> None:  # noqa: ANN001
    """`lightning-spec serve --engine vllm --learn`: a round of served requests is learned from
    the captured rows (no target pass), the new drafter is pushed and served, replies do not
    change, and SIGTERM stops server and learner cleanly."""
    import os
    import signal
    import subprocess
    import sys

    fitted = engine_drafter(NEW_TOKENS)
    fitted["drafter"].save_pretrained(tmp_path / "drafter")
    config = tmp_path / "learn.yaml"
    config.write_text(
        "strategy: {name: ogd, lr: 1.0e-3, epochs: 1, minibatch: 2}\nround_size: 4\ntree: chain:3\n"
    )
    port = _free_port()
    command = [sys.executable, "-m", "lightning_spec.cli", "serve", "--engine", "vllm", "--drafter",
               str(tmp_path / "drafter"), "--learn", str(config), "--out-dir", str(tmp_path / "out"),
               "--port", str(port)]  # fmt: skip
    with open(tmp_path / "serve.log", "w") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while (
            "learning:" not in (tmp_path / "serve.log").read_text() and time.monotonic() < deadline
        ):
            assert process.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(1)
        first = [_complete(url, p) for p in fitted["prompts"]]
        rounds = tmp_path / "out" / "learner" / "rounds.jsonl"
        deadline = time.monotonic() + 300
        while not rounds.is_file() and time.monotonic() < deadline:
            time.sleep(1)
        row = json.loads(rounds.read_text().splitlines()[0])
        assert row["captured"] == 4 and row.get("fallback", 0) == 0 and row["push_failed"] == 0.0
        with urllib.request.urlopen(url + "/lightning-spec/status", timeout=30) as answer:
            assert json.loads(answer.read())["served_sha256"] == row["served_sha256"]
        assert [_complete(url, p) for p in fitted["prompts"]] == first
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        code = process.wait(timeout=120)
    assert code == 0, (tmp_path / "serve.log").read_text()[-3000:]
