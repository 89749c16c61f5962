"""scripts/feedback_split.py: the learner's feedback from captured rows and from a target pass,
timed on the same requests, agree on a tiny target (records and labels)."""

from __future__ import annotations

import pytest
import torch

from lightning_spec.decoding.build import parse_tree_spec
from lightning_spec.decoding.engine import autoregressive_generate
from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
from lightning_spec.models.target import TargetModel
from lightning_spec.models.tiny import tiny_config
from lightning_spec.online.capture import CapturedRequest


def test_both_feedback_paths_are_timed_and_agree(study_script) -> None:  # noqa: ANN001
    probe = study_script("feedback_split")
    target = TargetModel.from_config(tiny_config("llama", num_layers=2), seed=3)
    drafter = Eagle3Drafter.from_target(target, intermediate_size=64)
    requests = []
    for i in range(3):
        prompt = [5 + i, 9, 17, 3, 40]
        tokens = prompt + autoregressive_generate(target, prompt, 10, stop_on_eos=False)
        with torch.no_grad():
            out = target(torch.tensor([tokens[:-1]]), use_cache=False)
        requests.append(
            CapturedRequest(
                f"r{i}", len(prompt), tokens, out.features[0], out.last_hidden[0], [1], [3]
            )
        )
    result = probe.split_feedback(target, drafter, parse_tree_spec("chain:3"), requests, labels=8)
    assert result["requests"] == 3 and result["verify_steps"] > 0
    assert result["captured_seconds"] > 0 and result["target_pass_seconds"] > 0
    assert result["max_label_logprob_difference"] < 1e-4
    assert result["captured_seconds_per_round_of_40"] == pytest.approx(
        result["captured_seconds"] * 40 / 3
    )
