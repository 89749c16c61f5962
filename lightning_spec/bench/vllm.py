"""vLLM in the loop: plain decoding, our drafter and vLLM's own ``ngram``, side by side.

vLLM pins its own torch, so it runs in its own environment (`lightning_spec.tools.vllm`) and
this module drives it through a subprocess: it writes a spec (target folder, modes, prompt ids),
runs `bench/vllm_worker.py` under vLLM's interpreter and reads back, per mode and prompt, the
reply, its seconds and vLLM's speculative-decoding counters. Results come back as the
engine-neutral `PromptResult`s of `bench/engines.py`, so tok/s, speedups, tau and greedy
mismatches are summarised exactly as llama.cpp's are.

Modes: ``plain``; ``eagle3@K`` and ``dflash@K`` (our drafter folder, ``num_speculative_tokens``
K: a chain of K, vLLM's only shape for these methods); ``ngram@K`` (vLLM's prompt lookup).
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_spec.bench.engines import PromptResult
from lightning_spec.tools.vllm import VllmEnv

__all__ = [
    "NGRAM_LOOKUP",
    "accepted_per_position",
    "kv_cache_share",
    "vllm_mode",
    "run_vllm",
    "target_folder",
    "to_prompt_results",
]

WORKER = Path(__file__).with_name("vllm_worker.py")
NGRAM_LOOKUP = {"prompt_lookup_min": 2, "prompt_lookup_max": 5}  # vLLM's documented example


def target_folder(target: str) -> Path:
    """The HF folder vLLM loads: the embedded default's de-quantized folder, or a local path."""
    if target == "smollm2":
        from lightning_spec.data.assets import default_target_path

        return default_target_path()
    path = Path(target).expanduser().resolve()  # the worker runs in another folder
    if not (path / "config.json").is_file():
        raise ValueError(f"{target} is not a local HF model folder (vLLM loads one)")
    return path


def vllm_mode(name: str, *, drafter: Path | None = None, k: int = 3) -> dict[str, Any]:
    """The worker's mode for ``plain``, ``eagle3``, ``dflash`` or ``ngram`` at K drafts."""
    if name == "plain":
        return {"name": "plain", "speculative_config": None}
    if name in ("eagle3", "dflash"):
        if drafter is None:
            raise ValueError(f"mode {name} needs the drafter folder")
        # absolute: the worker runs in another folder, and vLLM reads a relative path that is
        # not there as a hub repository id
        model = str(Path(drafter).expanduser().resolve())
        config = {"method": name, "model": model, "num_speculative_tokens": int(k)}
        return {"name": f"{name}@{k}", "speculative_config": config}
    if name == "ngram":
        config = {"method": "ngram", "num_speculative_tokens": int(k), **NGRAM_LOOKUP}
        return {"name": f"ngram@{k}", "speculative_config": config}
    raise ValueError(f"unknown vLLM mode {name!r}: plain, eagle3, dflash or ngram")


def to_prompt_results(worker_result: dict[str, Any]) -> dict[str, list[PromptResult]]:
    """The worker's one-at-a-time replies as `PromptResult`s; seconds are decode time, as
    llama.cpp's are: vLLM's first-to-last-token time, else wall time."""
    out: dict[str, list[PromptResult]] = {}
    for name, mode in worker_result["modes"].items():
        items = []
        for item in mode["prompts"]:
            seconds = item.get("decode_seconds")
            items.append(
                PromptResult(
                    tokens=[int(t) for t in item["tokens"]],
                    seconds=max(float(item["seconds"] if seconds is None else seconds), 1e-9),
                    drafted=int(item.get("drafted", 0)),
                    accepted=int(item.get("accepted", 0)),
                    meta={
                        "accepted_lengths": [int(a) for a in item.get("accepted_lengths", [])],
                        "wall_seconds": float(item["seconds"]),
                    },
                )
            )
        out[name] = items
    return out


def accepted_per_position(items: Sequence[PromptResult], depth: int) -> dict[str, list[Any]]:
    """vLLM's acceptance per draft position from its per-step records, pooled over prompts:
    ``reach`` (the share of verify steps whose first j drafts were all accepted, with the
    interval `reach_per_position` gives ours) and ``alpha`` (position j accepted given j - 1
    were: our decoder's `alpha_j`)."""
    lengths = [list(r.meta.get("accepted_lengths", [])) for r in items]
    steps = sum(len(x) for x in lengths)
    reach = [sum(1 for x in lengths for a in x if a >= j) / steps if steps else None
             for j in range(1, depth + 1)]  # fmt: skip
    alpha, previous = [], 1.0 if steps else None
    for value in reach:
        alpha.append(value / previous if value is not None and previous else None)
        previous = value
    return {"reach": reach, "alpha": alpha, "steps": steps}


def kv_cache_share(engines: int, *, total_gib: int = 12, most_gib: int = 4) -> int:
    """GiB of KV cache per engine when `engines` run side by side: `total_gib` shared, at most
    `most_gib` and at least 1 each. Six engines did not fit a 24 GiB machine at vLLM's default
    4 GiB, nor at 2 GiB each once the page cache held 9 GiB (vLLM's CPU worker checks free, not
    available, memory), so `--k auto` calibrates one engine at a time. 1 GiB holds ~23k
    SmolLM2 tokens (46 KB each in fp32); a batch that needs more waits in vLLM's scheduler."""
    return max(1, min(most_gib, total_gib // max(1, engines)))


def run_vllm(
    env: VllmEnv,
    target: Path,
    modes: Sequence[dict[str, Any]],
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    batched: Sequence[int] = (),
    warmup: int = 1,
    enforce_eager: bool = True,
    dtype: str = "float32",
    log: Path | None = None,
    timeout: float | None = None,
    kv_cache_gib: int | None = None,
) -> dict[str, Any]:
    """Run the worker under vLLM's interpreter; its result (see `bench/vllm_worker.py`).

    Every mode's engine stays up for the whole run, each with its own KV cache:
    `kv_cache_gib` (default `kv_cache_share`) keeps them inside the machine's memory."""
    spec = {
        "target": str(Path(target).expanduser().resolve()), "dtype": dtype, "modes": list(modes),
        "prompts": [[int(t) for t in ids] for ids in prompts],
        "max_new_tokens": int(max_new_tokens), "batched": [int(b) for b in batched],
        "warmup": int(warmup), "enforce_eager": bool(enforce_eager),
    }  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as tmp:
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        command = [str(env.python), str(WORKER), str(spec_path), str(result_path)]
        with open(log, "w") if log is not None else open(Path(tmp) / "log", "w") as handle:
            process = subprocess.run(
                command, env=env.environ(kv_cache_gib=kv_cache_gib or kv_cache_share(len(modes))),
                stdout=handle, stderr=subprocess.STDOUT,
                timeout=timeout, check=False, cwd=tmp,
            )  # fmt: skip
        if process.returncode != 0 or not result_path.is_file():
            where = f" (log: {log})" if log is not None else ""
            raise RuntimeError(f"the vLLM worker exited with {process.returncode}{where}")
        return json.loads(result_path.read_text())
