"""A drafter pushed into a running vLLM engine (its CPU build) is served from the next request,
outputs stay vLLM plain's greedy text, and a bad push leaves the engine serving the drafter it
had. Slow: the real SmolLM2 and vLLM's engine start-up; skipped where vLLM-CPU is not installed
(`./scripts/build_vllm.sh`)."""

from __future__ import annotations

import shutil

import pytest

from tests.conftest import noisy_copy

pytestmark = pytest.mark.slow

CHAIN, NEW_TOKENS = 3, 40


def test_a_push_changes_what_vllm_drafts_never_what_it_outputs(
    tmp_path, engine_drafter, vllm_env
) -> None:  # noqa: ANN001
    from lightning_spec.bench.vllm import run_vllm, to_prompt_results, vllm_mode
    from lightning_spec.data.assets import default_target_path
    from lightning_spec.online.engines import PushFailed, engine_tau
    from lightning_spec.online.vllm_engine import VllmOnlineEngine

    env = vllm_env
    fitted = engine_drafter(NEW_TOKENS)
    prompts, drafter = fitted["prompts"], fitted["drafter"]
    drafter.save_pretrained(tmp_path / "fitted")
    noisy_copy(tmp_path / "fitted", tmp_path / "noisy")  # the same shapes, drafting worse
    shutil.copytree(tmp_path / "fitted", tmp_path / "cut")
    weights = tmp_path / "cut" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    plain = to_prompt_results(run_vllm(env, default_target_path(), [vllm_mode("plain")], prompts,
                                       max_new_tokens=NEW_TOKENS, log=tmp_path / "plain.log"))  # fmt: skip
    reference = [r.tokens for r in plain["plain"]]
    with VllmOnlineEngine(env, default_target_path(), tmp_path / "fitted", k=CHAIN,
                          log=tmp_path / "engine.log") as engine:  # fmt: skip
        start = engine.serve(prompts, NEW_TOKENS)
        engine.push(tmp_path / "noisy")
        worse = engine.serve(prompts, NEW_TOKENS)
        engine.push(tmp_path / "fitted")
        back = engine.serve(prompts, NEW_TOKENS)
        with pytest.raises(PushFailed, match="safetensors"):
            engine.push(tmp_path / "cut")
        after_refusal = engine.serve(prompts, NEW_TOKENS)
    for served in (start, worse, back, after_refusal):
        assert [r.tokens for r in served] == reference  # lossless across every push
    drafts = [[r.meta["accepted_lengths"] for r in s] for s in (start, worse, back, after_refusal)]
    assert drafts[1] != drafts[0] and drafts[2] == drafts[0] and drafts[3] == drafts[0]
    taus = [engine_tau(s)[0] for s in (start, worse, back, after_refusal)]
    print(
        f"vLLM tau: start {taus[0]:.3f}, noisy {taus[1]:.3f}, back {taus[2]:.3f}, after refusal {taus[3]:.3f}"
    )
    assert taus[1] < taus[0]  # the noisy drafter is what vLLM drafted with
