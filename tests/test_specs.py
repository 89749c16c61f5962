"""specs: every spelling of a target, a drafter, a prompt set and a tree policy, on tiny models."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_spec import specs
from lightning_spec.decoding.build import ChainPolicy, DynamicTreePolicy, StaticTreePolicy
from lightning_spec.models import target as target_module
from lightning_spec.models.drafters.bigram import BigramDrafter
from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
from lightning_spec.models.drafters.standalone import StandaloneDrafter


@pytest.fixture()
def fresh_target_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """`load_target` shares targets in the process: keep this test's out of the others'."""
    monkeypatch.setattr(target_module, "_LOADED", {})


@pytest.fixture()
def target(tiny_cli_assets: dict[str, str], fresh_target_cache: None) -> object:
    return specs.resolve_target(tiny_cli_assets["model"])


# ---------------------------------------------------------------------------------- targets
def test_target_from_a_model_folder_is_loaded_once(
    tiny_cli_assets: dict[str, str], fresh_target_cache: None
) -> None:
    target = specs.resolve_target(tiny_cli_assets["model"])
    assert target.vocab_size == int(tiny_cli_assets["vocab"])
    assert target.tokenizer is not None and target.dtype == torch.float32
    assert specs.resolve_target(tiny_cli_assets["model"]) is target
    assert specs.resolve_target(tiny_cli_assets["model"], "bf16").dtype == torch.bfloat16


def test_target_smollm2_names_the_cached_default_folder(
    tiny_cli_assets: dict[str, str], fresh_target_cache: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_spec.data import assets

    monkeypatch.setattr(assets, "default_target_path", lambda: Path(tiny_cli_assets["model"]))
    for name in ("smollm2", "default"):
        target = specs.resolve_target(name)
        assert target.vocab_size == int(tiny_cli_assets["vocab"])


def test_target_gguf_and_bad_folders_fail_clearly(tmp_path: Path, fresh_target_cache: None) -> None:
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        specs.resolve_target(str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        specs.resolve_target(str(tmp_path))


# ---------------------------------------------------------------------------------- drafters
def test_drafter_folder_is_loaded_on_the_target_device_and_dtype(
    target: object, tmp_path: Path
) -> None:
    saved = Eagle3Drafter.from_target(target, draft_vocab_size=16, seed=4)
    saved.save_pretrained(tmp_path / "drafter")
    drafter = specs.resolve_drafter(str(tmp_path / "drafter"), target)
    assert isinstance(drafter, Eagle3Drafter)
    assert next(drafter.parameters()).dtype == target.dtype
    for name, tensor in saved.state_dict().items():
        torch.testing.assert_close(drafter.state_dict()[name], tensor)


def test_random_is_an_untrained_eagle3_head_in_eval_mode(target: object) -> None:
    drafter = specs.resolve_drafter("random", target, draft_vocab_size=16, seed=1)
    assert isinstance(drafter, Eagle3Drafter) and not drafter.training
    assert drafter.config["draft_vocab_size"] == 16
    again = specs.resolve_drafter("random", target, draft_vocab_size=16, seed=1)
    other = specs.resolve_drafter("random", target, draft_vocab_size=16, seed=2)
    name = next(n for n, _ in drafter.named_parameters() if "embed" not in n)
    torch.testing.assert_close(drafter.state_dict()[name], again.state_dict()[name])
    assert not torch.equal(drafter.state_dict()[name], other.state_dict()[name])
    full = specs.resolve_drafter("random", target)
    assert full.config["draft_vocab_size"] == target.vocab_size


def test_self_is_the_target_drafting_for_itself(target: object) -> None:
    drafter = specs.resolve_drafter("self", target)
    assert isinstance(drafter, StandaloneDrafter)
    assert drafter.lm is target.model
    assert drafter.config["target_model"] == str(target.name)


def test_bigram_from_a_data_source_and_from_its_folder(
    target: object, tiny_cli_assets: dict[str, str], tmp_path: Path
) -> None:
    built = specs.resolve_drafter(f"bigram:{tiny_cli_assets['chats']}", target, bigram_limit=10)
    assert isinstance(built, BigramDrafter)
    assert built.config["source"] == tiny_cli_assets["chats"]
    assert built.config["num_tokens"] > 0
    built.save_pretrained(tmp_path / "bigram")
    loaded = specs.resolve_drafter(f"bigram:{tmp_path / 'bigram'}", target)
    assert isinstance(loaded, BigramDrafter)
    assert loaded.config["num_tokens"] == built.config["num_tokens"]


def test_unknown_drafters_name_the_accepted_forms(target: object, tmp_path: Path) -> None:
    for spec in ("nonsense", str(tmp_path / "no-such-folder"), str(tmp_path)):
        with pytest.raises(ValueError, match="drafter folder, random, self or bigram"):
            specs.resolve_drafter(spec, target)


# ---------------------------------------------------------------------------------- prompts
def _prompt_file(path: Path) -> Path:
    rows = [{"prompt": f"word{i} hello there", "category": "aaabbbcc"[i]} for i in range(8)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_prompts_from_a_jsonl_file_stratified_or_first(target: object, tmp_path: Path) -> None:
    path = _prompt_file(tmp_path / "mine.jsonl")
    name, items = specs.load_prompts(str(path), target.tokenizer)
    assert name == "mine" and len(items) == 8
    ids, meta = items[0]
    assert all(isinstance(i, int) for i in ids) and meta["category"] == "a"
    # The chat template is applied: a rendered prompt is longer than its words.
    assert len(ids) > len(target.tokenizer("word0 hello there")["input_ids"])
    _, stratified = specs.load_prompts(str(path), target.tokenizer, 3)
    assert [meta["category"] for _, meta in stratified] == ["a", "b", "c"]
    _, first = specs.load_prompts(str(path), target.tokenizer, 3, selection="first")
    assert [meta["category"] for _, meta in first] == ["a", "a", "a"]


def test_prompts_need_a_tokenizer_and_a_known_selection(target: object, tmp_path: Path) -> None:
    path = _prompt_file(tmp_path / "mine.jsonl")
    with pytest.raises(ValueError, match="no tokenizer"):
        specs.load_prompts(str(path), None)
    with pytest.raises(ValueError, match="stratified or first"):
        specs.load_prompts(str(path), target.tokenizer, 2, selection="random")
    with pytest.raises(FileNotFoundError):
        specs.load_prompts(str(tmp_path / "missing.jsonl"), target.tokenizer)


# ---------------------------------------------------------------------------------- trees
def test_every_tree_spelling() -> None:
    chain = specs.resolve_tree("chain:3")
    assert isinstance(chain, ChainPolicy) and chain.k == 3
    dynamic = specs.resolve_tree("dynamic:4,3,10")
    assert isinstance(dynamic, DynamicTreePolicy)
    assert (dynamic.depth, dynamic.top_k, dynamic.total_tokens) == (4, 3, 10)
    assert isinstance(specs.resolve_tree("static:tiny"), StaticTreePolicy)
    assert isinstance(specs.resolve_tree("static:[(0,), (1,), (0, 0)]"), StaticTreePolicy)
    for bad in ("auto", "chain", "chain:x", "static:nope", "dynamic:1,2", "beam:3"):
        with pytest.raises(ValueError, match="bad tree spec"):
            specs.resolve_tree(bad)


# ---------------------------------------------------------------------------------- layering
def test_specs_imports_no_cli_and_nothing_heavy() -> None:
    tree = ast.parse(Path(specs.__file__).read_text())
    imported = {
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    assert not {name for name in imported if name and name.startswith("lightning_spec.cli")}
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, lightning_spec.specs; "
            "print(sorted(m for m in ('torch', 'transformers', 'lightning_spec.cli') "
            "if m in sys.modules))",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.stdout.strip() == "[]", probe.stderr
