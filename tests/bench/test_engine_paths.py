"""Every engine command hands absolute paths on, and refuses a bad drafter folder before any
long work.

vLLM and llama.cpp run in other processes, from other folders: `bench vllm --drafter
runs/quickstart/drafter/last`, as the guide writes it, once computed our decoder's side for 15
minutes and then failed because vLLM's worker read the relative path as a hub repository id.
Each documented command is run here through its argument handling, with its paths as the guide
writes them (relative, from a scratch working folder), up to the point where an engine would
start: what the engine would receive is captured and must be absolute. No engine is needed.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


class _EngineReached(Exception):
    """Raised where the engine would start: the command's own work before it is done."""


def documented(page: str, prefix: tuple[str, ...]) -> list[list[str]]:
    """The command lines of `page`'s shell blocks that start with `prefix` (continuations
    joined, comments cut, `.venv/bin/` dropped), as argv lists."""
    text = (ROOT / "docs" / page).read_text(encoding="utf-8")
    commands = []
    for block in text.split("```")[1::2]:
        language, _, body = block.partition("\n")
        if language.strip().lower() not in {"", "bash", "sh", "shell", "console"}:
            continue
        for line in body.replace("\\\n", " ").splitlines():
            line = line.split(" # ")[0].strip().removeprefix(".venv/bin/")
            if line.startswith(" ".join(prefix) + " "):
                commands.append(shlex.split(line))
    assert commands, f"docs/{page} shows no `{' '.join(prefix)}` command"
    return commands


def _option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def _drafter_folder(folder: Path, *, target: str, drafter_type: str = "eagle3") -> Path:
    """A drafter folder as training leaves it (config.json naming its target, the weights)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {"drafter_type": drafter_type, "target_model": target}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"weights")
    return folder


def _target_folder(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text("{}")
    return folder


def test_bench_vllm_hands_vllm_absolute_paths_and_runs_vllm_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_spec.bench import vllm_bench

    monkeypatch.chdir(tmp_path)
    _target_folder(tmp_path / "models" / "target")
    calls: list[str] = []
    captured: dict = {}

    def run_vllm(env, target, modes, prompts, **kwargs):  # noqa: ANN001, ANN003, ANN202
        calls.append("vllm")
        captured.update(target=target, modes=modes, log=kwargs.get("log"))
        raise _EngineReached

    monkeypatch.setattr(vllm_bench, "ensure_vllm", lambda version: SimpleNamespace(preload=()))
    monkeypatch.setattr(vllm_bench, "engine_prompts", lambda *a: ([[1, 2, 3]], ["mtbench"]))
    monkeypatch.setattr(vllm_bench, "ours_tau", lambda *a: calls.append("ours"))
    monkeypatch.setattr(vllm_bench, "run_vllm", run_vllm)
    for argv in documented("vllm.md", ("lightning-spec", "bench", "vllm")):
        drafter = _option(argv, "--drafter")
        assert not Path(drafter).is_absolute()  # as the guide writes it
        _drafter_folder(tmp_path / drafter, target="models/target")
        calls.clear()
        with pytest.raises(_EngineReached):
            vllm_bench.main(argv[3:])
        assert calls == ["vllm"]  # vLLM loads the drafter before our decoder's side runs
        assert Path(captured["target"]).is_absolute()
        assert Path(captured["target"]) == (tmp_path / "models" / "target").resolve()
        served = [m["speculative_config"]["model"] for m in captured["modes"]
                  if m["speculative_config"] and "model" in m["speculative_config"]]  # fmt: skip
        assert served and all(Path(s).is_absolute() for s in served)
        assert {Path(s) for s in served} == {(tmp_path / drafter).resolve()}
        assert Path(captured["log"]).is_absolute()


def test_bench_llamacpp_hands_llamacpp_absolute_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_spec.bench import llamacpp_bench

    monkeypatch.chdir(tmp_path)
    captured: dict = {}

    def export(drafter, workdir, **kwargs):  # noqa: ANN001, ANN003, ANN202
        captured.update(drafter=drafter, workdir=workdir)
        raise _EngineReached

    built = SimpleNamespace(version="test", binary=lambda name: Path("/bin") / name)
    monkeypatch.setattr(llamacpp_bench, "ensure_llamacpp", lambda: built)
    monkeypatch.setattr(llamacpp_bench, "engine_prompts", lambda *a: ([[1, 2, 3]], ["mtbench"]))
    monkeypatch.setattr(llamacpp_bench, "ours_tau", lambda *a: pytest.fail("ours ran first"))
    monkeypatch.setattr(llamacpp_bench, "export_gguf_package", export)
    for argv in documented("llamacpp.md", ("lightning-spec", "bench", "llamacpp")):
        drafter = _option(argv, "--drafter")
        _drafter_folder(tmp_path / drafter, target="smollm2")
        with pytest.raises(_EngineReached):
            llamacpp_bench.main([*argv[3:], "--workdir", "exports"])
        assert Path(captured["drafter"]) == (tmp_path / drafter).resolve()
        assert Path(captured["workdir"]) == (tmp_path / "exports").resolve()


@pytest.mark.parametrize("bench", ["vllm_bench", "llamacpp_bench"])
def test_a_bad_drafter_folder_fails_before_any_work(
    bench: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    import importlib

    from lightning_spec.bench.engines import engine_drafter

    module = importlib.import_module(f"lightning_spec.bench.{bench}")
    monkeypatch.chdir(tmp_path)
    for name in ("ensure_vllm", "ensure_llamacpp", "engine_prompts", "ours_tau"):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, lambda *a, **k: pytest.fail("work started"))
    weightless = tmp_path / "runs" / "weightless"
    weightless.mkdir(parents=True)
    (weightless / "config.json").write_text("{}")
    _drafter_folder(tmp_path / "runs" / "hydra", target="smollm2", drafter_type="hydra")
    cases = {"runs/missing": "is not a folder", "runs/weightless": "model.safetensors",
             "runs/hydra": "eagle3 and dflash"}  # fmt: skip
    for drafter, message in cases.items():
        with pytest.raises(ValueError, match=message):
            engine_drafter(drafter, "vLLM")
        with pytest.raises(SystemExit) as stopped:
            module.main(["--drafter", drafter, "--output", "out.json"])
        assert stopped.value.code == 2
        assert message in capsys.readouterr().err
    good = _drafter_folder(tmp_path / "runs" / "good", target="smollm2")
    folder, config = engine_drafter("runs/../runs/good/", "vLLM")
    assert folder == good.resolve() and folder.is_absolute() and config["drafter_type"] == "eagle3"


def test_online_with_vllm_hands_the_engine_absolute_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every `online` config served by vLLM (recipes and the studies' arms the guide shows), its drafter path as the config writes
    it; the target a relative local folder too."""
    import lightning_spec.online.vllm_engine as vllm_engine
    import lightning_spec.tools.vllm as vllm_tool
    from lightning_spec.cli.online import check_engine_drafter, load_config, start_vllm_engine

    captured: dict = {}

    class Engine:
        def __init__(self, env, target, drafter, **kwargs):  # noqa: ANN001, ANN003
            captured.update(target=target, drafter=drafter)

    monkeypatch.setattr(vllm_engine, "VllmOnlineEngine", Engine)
    monkeypatch.setattr(vllm_tool, "ensure_vllm", lambda *a, **k: SimpleNamespace())
    monkeypatch.chdir(tmp_path)
    _target_folder(tmp_path / "models" / "target")
    files = sorted((ROOT / "configs").rglob("*.yaml")) + sorted(ROOT.glob("experiments/*/configs/*.yaml"))
    configs = [p for p in files if (yaml.safe_load(p.read_text()) or {}).get("engine") == "vllm"]
    assert configs, "no documented online config served by vLLM"
    for path in configs:
        config = load_config(path, {"target": "models/target"})
        drafter = str(config["drafter"])
        assert not Path(drafter).is_absolute()
        _drafter_folder(tmp_path / drafter, target="models/target")
        check_engine_drafter(config)
        start_vllm_engine(config, tmp_path / "out")
        assert captured["drafter"] == (tmp_path / drafter).resolve()
        assert captured["target"] == (tmp_path / "models" / "target").resolve()


def test_serve_resolves_its_drafter_and_output_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_spec.cli.serve import _parser, resolve_paths

    monkeypatch.chdir(tmp_path)
    argv = ["--drafter", "DIR", "--strategy", "ogd", "--port", "8000"]  # docs/commands.md
    args = resolve_paths(_parser().parse_args([*argv, "--out-dir", "runs/serve"]))
    assert args.drafter == str((tmp_path / "DIR").resolve())
    assert args.out_dir == str((tmp_path / "runs" / "serve").resolve())
    for name in ("random", "self", "bigram:sharegpt"):
        assert resolve_paths(_parser().parse_args(["--drafter", name])).drafter == name
