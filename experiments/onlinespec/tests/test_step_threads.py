"""scripts/step_threads.py: live step cost per thread count, interleaved, on a tiny target."""

from __future__ import annotations

import pytest
import torch

from lightning_spec.decoding.build import parse_tree_spec
from lightning_spec.decoding.engine import SpeculativeDecoder
from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
from lightning_spec.models.target import TargetModel
from lightning_spec.models.tiny import tiny_config


def test_each_thread_count_decodes_every_prompt_twice_and_the_count_is_restored(
    study_script,  # noqa: ANN001
) -> None:
    probe = study_script("step_threads")
    target = TargetModel.from_config(tiny_config("llama", num_layers=2), seed=11)
    drafter = Eagle3Drafter.from_target(target, intermediate_size=64)
    decoder = SpeculativeDecoder(target, drafter, parse_tree_spec("dynamic:2,2,4"))
    prompts = [[5, 9, 17, 3], [8, 8, 40, 2, 11]]
    single = sum(decoder.generate(p, 6).num_verifications for p in prompts)
    before = torch.get_num_threads()
    figures = probe.interleaved_step_costs(decoder, prompts, [2, 1], max_new_tokens=6)
    assert torch.get_num_threads() == before
    assert set(figures) == {1, 2}
    for entry in figures.values():
        assert entry["steps"] == 2 * single  # greedy: the same steps at every thread count
        assert entry["ms_per_step"] == pytest.approx(1000 * entry["seconds"] / entry["steps"])
