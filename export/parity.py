"""onnxruntime vs PyTorch: the exported graphs must compute what the drafter computes.

Three levels of evidence, each cheap enough for CI on a tiny drafter:

* `step_parity`: random inputs at several (batch, tokens, past) sizes, batch 1, a single token
  and an empty past (prefill) included, with random tree masks; max abs diff of every output
  and argmax agreement of the logits.
* `rollout_parity`: the inputs the decoder really produces: a prefill from target features
  (real ones when given, random otherwise) followed by chain steps that feed the drafter its own
  greedy tokens and hidden states over a growing cache.
* `decode_parity`: `SpeculativeDecoder` run twice on the same target, once with the PyTorch
  drafter and `verify_greedy`, once with `OnnxEagle3Drafter` and `OnnxTreeVerifier`; the
  generated tokens, the drafted trees and the accepted lengths must agree step for step.

`OnnxEagle3Drafter` is a `Drafter` whose `step` runs `fc.onnx` / `drafter_step.onnx` through
onnxruntime (state: a `KVState` of CPU torch tensors); `OnnxTreeVerifier` is a `greedy_verifier`
for the decoder running `tree_verify.onnx`. Neither needs the PyTorch weights: only the export
folder (the copied drafter folder supplies the config and the draft-vocabulary map).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_spec.export.onnx import FC_FILE, STEP_FILE, STEP_INPUTS, step_example_inputs
from lightning_spec.export.verify_graph import DEFAULT_MAX_NODES, VERIFY_FILE
from lightning_spec.models.drafters.base import CONFIG_NAME, WEIGHTS_NAME, Drafter, DrafterOutput
from lightning_spec.models.drafters.eagle3 import Eagle3Drafter, KVState

#: (batch, tokens, past) sizes checked by default: batch 1, one token and an empty past included.
DEFAULT_STEP_CASES: tuple[tuple[int, int, int], ...] = (
    (1, 1, 0),
    (1, 1, 1),
    (1, 6, 0),
    (2, 1, 9),
    (3, 4, 2),
    (2, 8, 16),
)
#: float32 onnxruntime vs PyTorch: pass when max_abs_diff <= atol + rtol * reference_scale
#: (reference_scale = the largest |PyTorch output| compared, since hidden states of real
#: targets reach the hundreds) and the logits' argmax agree at least this often. Observed:
#: ~1e-6 on tiny random drafters, ~1e-5 (random) and 8e-4 at scale ~1e2 (real features) for a
#: SmolLM2 drafter.
DEFAULT_TOLERANCES = {"atol": 1e-4, "rtol": 1e-5, "min_argmax_agreement": 0.99}
DRAFTER_FOLDER = "drafter"


def ort_session(
    path: str | Path, providers: Sequence[str] | None = None, threads: int = 0
) -> Any:
    """An onnxruntime session of the graph at `path` (CPU unless `providers` says otherwise),
    quiet and without busy-waiting threads; `threads` > 0 caps its intra-op threads."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    # No busy-waiting between runs: the decoder alternates onnxruntime with torch kernels, and
    # spinning worker threads would steal the cores torch needs.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if threads:
        options.intra_op_num_threads = threads
    return ort.InferenceSession(
        str(path), sess_options=options, providers=list(providers or ["CPUExecutionProvider"])
    )


def _numpy(tensor: Tensor, dtype: Any | None = None) -> np.ndarray:
    array = tensor.detach().cpu()
    if array.dtype == torch.bfloat16:
        array = array.float()
    array = array.numpy()
    if dtype is not None:
        array = array.astype(dtype, copy=False)
    return np.ascontiguousarray(array)  # onnxruntime wants C-contiguous buffers


def random_tree_mask(batch: int, tokens: int, past: int, generator: torch.Generator) -> Tensor:
    """Bool [B, T, P + T]: full past, and the ancestor mask of a random tree over the new tokens."""
    mask = torch.zeros(batch, tokens, past + tokens, dtype=torch.bool)
    mask[:, :, :past] = True
    for b in range(batch):
        for i in range(tokens):
            parent = int(torch.randint(-1, i, (1,), generator=generator)) if i else -1
            mask[b, i, past + i] = True
            if parent >= 0:
                mask[b, i, past : past + tokens] |= mask[b, parent, past : past + tokens]
    return mask


def compare_outputs(reference: Tensor, candidate: np.ndarray) -> tuple[float, float]:
    """(max |reference - candidate|, max |reference|)."""
    reference = _numpy(reference, np.float32)
    diff = float(np.max(np.abs(reference - candidate), initial=0.0))
    return diff, float(np.max(np.abs(reference), initial=0.0))


def argmax_agreement(reference: Tensor, candidate: np.ndarray) -> tuple[int, int]:
    """(rows whose argmax over the last axis agrees, rows compared)."""
    ref = reference.argmax(dim=-1).cpu().numpy()
    got = candidate.argmax(axis=-1)
    return int((ref == got).sum()), int(ref.size)


@torch.no_grad()
def step_parity(
    drafter: Eagle3Drafter,
    export_dir: str | Path,
    *,
    cases: Iterable[tuple[int, int, int]] = DEFAULT_STEP_CASES,
    seed: int = 0,
    providers: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Random-input parity of `drafter_step.onnx` and `fc.onnx` with the PyTorch drafter."""
    from lightning_spec.export.onnx import DrafterStepGraph, export_ready

    export_dir = Path(export_dir)
    model = export_ready(drafter)
    graph = DrafterStepGraph(model)
    step_session = ort_session(export_dir / STEP_FILE, providers)
    fc_session = ort_session(export_dir / FC_FILE, providers)
    generator = torch.Generator().manual_seed(seed)
    results = []
    agree = total = 0
    worst = scale = 0.0
    for index, (batch, tokens, past) in enumerate(cases):
        inputs = list(step_example_inputs(model, batch, tokens, past, seed=seed + index))
        inputs[5] = random_tree_mask(batch, tokens, past, generator)
        reference = graph(*inputs)
        outputs = step_session.run(
            None, {n: _numpy(t) for n, t in zip(STEP_INPUTS, inputs, strict=True)}
        )
        compared = {
            name: compare_outputs(ref, out)
            for name, ref, out in zip(
                ("logits", "hidden_out", "present_keys", "present_values"),
                reference,
                outputs,
                strict=True,
            )
        }
        features = torch.randn(batch, tokens, model.fc.in_features, generator=generator)
        (fc_out,) = fc_session.run(None, {"features": _numpy(features)})
        compared["fc_hidden"] = compare_outputs(model.fuse(features), fc_out)
        diffs = {name: diff for name, (diff, _) in compared.items()}
        scale = max(scale, *(ref_scale for _, ref_scale in compared.values()))
        hits, count = argmax_agreement(reference[0], outputs[0])
        agree, total = agree + hits, total + count
        worst = max(worst, *diffs.values())
        results.append(
            {
                "batch": batch,
                "tokens": tokens,
                "past": past,
                "max_abs_diff": diffs,
                "argmax_agreement": hits / count,
            }
        )
    return {
        "cases": results,
        "max_abs_diff": worst,
        "reference_scale": scale,
        "argmax_agreement": agree / max(total, 1),
    }


# --------------------------------------------------------------------------------- onnx drafter
class OnnxEagle3Drafter(Drafter):
    """An EAGLE-3 drafter whose `step` runs the exported graphs through onnxruntime.

    It speaks the same `Drafter` interface as `Eagle3Drafter`, so the `SpeculativeDecoder` uses
    it unchanged. Tensors handed in may live on any device; results come back on the device of
    `input_ids` in float32. The cache is a `KVState` of CPU tensors.
    """

    drafter_type = "eagle3-onnx"
    needs_features = True

    def __init__(
        self,
        config: dict[str, Any],
        step_path: str | Path,
        fc_path: str | Path,
        d2t: Tensor | None = None,
        *,
        providers: Sequence[str] | None = None,
        threads: int = 0,
    ) -> None:
        config = dict(config)
        config.setdefault("draft_vocab_size", config["target_vocab_size"])
        config.setdefault(
            "head_dim", int(config["hidden_size"]) // int(config["num_attention_heads"])
        )
        super().__init__(config)
        self.step_session = ort_session(step_path, providers, threads)
        self.fc_session = ort_session(fc_path, providers, threads)
        if d2t is None:
            d2t = torch.zeros(int(config["draft_vocab_size"]), dtype=torch.long)
        self.register_buffer("d2t", d2t.to(torch.long).cpu())
        self.kv_heads = int(config["num_key_value_heads"])
        self.head_dim = int(config["head_dim"])

    @classmethod
    def from_export_dir(
        cls,
        export_dir: str | Path,
        *,
        providers: Sequence[str] | None = None,
        threads: int = 0,
    ) -> OnnxEagle3Drafter:
        """Load from a folder written by `lightning-spec export` (graphs + drafter/ copy)."""
        from safetensors import safe_open

        export_dir = Path(export_dir)
        folder = export_dir / DRAFTER_FOLDER
        config = json.loads((folder / CONFIG_NAME).read_text())
        config = Eagle3Drafter.from_config_dict(config).config
        with safe_open(str(folder / WEIGHTS_NAME), framework="pt") as weights:
            d2t = weights.get_tensor("d2t") if "d2t" in weights.keys() else None
        return cls(
            config,
            export_dir / STEP_FILE,
            export_dir / FC_FILE,
            d2t,
            providers=providers,
            threads=threads,
        )

    # The vocabulary maps are exactly the PyTorch drafter's (they read only config and d2t).
    draft_vocab_size = Eagle3Drafter.draft_vocab_size
    to_target = Eagle3Drafter.to_target
    target_to_draft_ids = Eagle3Drafter.target_to_draft_ids

    # The cache bookkeeping is the PyTorch drafter's too: both hold a KVState of tensors.
    new_state = Eagle3Drafter.new_state
    state_length = Eagle3Drafter.state_length
    truncate_state = Eagle3Drafter.truncate_state
    keep_state_entries = Eagle3Drafter.keep_state_entries

    def project_features(self, features: Tensor) -> Tensor:
        """Run `fc.onnx`: fused target features [B, T, F] -> hidden [B, T, H] (CPU float32)."""
        (hidden,) = self.fc_session.run(None, {"features": _numpy(features, np.float32)})
        return torch.from_numpy(hidden)

    def step(
        self,
        state: KVState,
        input_ids: Tensor,
        position_ids: Tensor,
        *,
        features: Tensor | None = None,
        hidden: Tensor | None = None,
        mask: Tensor | None = None,
    ) -> DrafterOutput:
        if (features is None) == (hidden is None):
            raise ValueError("OnnxEagle3Drafter.step needs exactly one of `features` or `hidden`")
        device = input_ids.device
        batch, tokens = input_ids.shape
        hidden_in = self.project_features(features) if features is not None else hidden
        past = state.length
        if state.keys is None:
            empty = torch.zeros(batch, self.kv_heads, 0, self.head_dim)
            state.keys, state.values = empty, empty.clone()
        if mask is None:
            mask = torch.ones(tokens, past + tokens, dtype=torch.bool)
            mask[:, past:] = torch.tril(mask[:, past:])
        if mask.dim() == 2:
            mask = mask.unsqueeze(0)
        if mask.shape[-2:] != (tokens, past + tokens):
            raise ValueError(
                f"mask must be [B, {tokens}, {past + tokens}], got {tuple(mask.shape)}"
            )
        mask = mask.to(torch.bool).expand(batch, -1, -1)
        feeds = {
            "input_ids": _numpy(input_ids, np.int64),
            "position_ids": _numpy(position_ids.expand(batch, -1), np.int64),
            "hidden_in": _numpy(hidden_in, np.float32),
            "past_keys": _numpy(state.keys, np.float32),
            "past_values": _numpy(state.values, np.float32),
            "attention_mask": _numpy(mask),
        }
        logits, hidden_out, keys, values = self.step_session.run(None, feeds)
        state.keys, state.values = torch.from_numpy(keys), torch.from_numpy(values)
        return DrafterOutput(
            logits=torch.from_numpy(logits).to(device),
            hidden=torch.from_numpy(hidden_out).to(device),
        )


class OnnxTreeVerifier:
    """`tree_verify.onnx` behind the decoder's `greedy_verifier` signature."""

    def __init__(
        self,
        path: str | Path,
        *,
        max_nodes: int | None = None,
        providers: Sequence[str] | None = None,
        threads: int = 0,
    ) -> None:
        self.session = ort_session(path, providers, threads)
        props = dict(self.session.get_modelmeta().custom_metadata_map)
        self.max_nodes = int(max_nodes or props.get("max_nodes", DEFAULT_MAX_NODES))

    @classmethod
    def from_export_dir(cls, export_dir: str | Path, **kwargs: Any) -> OnnxTreeVerifier:
        return cls(Path(export_dir) / VERIFY_FILE, **kwargs)

    def run(
        self, draft_tokens: Tensor, parents: Tensor, target_logits: Tensor
    ) -> tuple[int, Tensor, int]:
        """(accept_length, path [N] padded with -1, bonus_token) for one tree."""
        n = int(draft_tokens.shape[0])
        if n > self.max_nodes:
            raise ValueError(
                f"tree of {n} nodes exceeds the verify graph's max_nodes={self.max_nodes}: "
                "export it again with a larger --max-tree-nodes"
            )
        accept_length, path, bonus = self.session.run(
            None,
            {
                "draft_tokens": _numpy(draft_tokens, np.int64),
                "parents": _numpy(parents, np.int64),
                "target_logits": _numpy(target_logits, np.float32),
            },
        )
        return int(accept_length), torch.from_numpy(path), int(bonus)

    def __call__(self, tree: Any, target_logits: Tensor) -> Any:
        from lightning_spec.decoding.verify import Verification

        accept_length, path, bonus = self.run(tree.tokens, tree.parents, target_logits)
        accepted = path[:accept_length].to(device=tree.tokens.device, dtype=torch.long)
        return Verification(accepted=accepted, bonus_token=bonus)


# ----------------------------------------------------------------------------- tree reference
def reference_greedy_verify(
    draft_tokens: Sequence[int], parents: Sequence[int], target_logits: Tensor | np.ndarray
) -> tuple[int, list[int], int]:
    """Plain-Python greedy tree verification: (accept_length, path, bonus_token).

    Written as the obvious walk in index order, independent of both the graph and the PyTorch
    implementation, so it can referee them.
    """
    argmax = np.asarray(
        target_logits.float().cpu() if isinstance(target_logits, Tensor) else target_logits
    ).argmax(axis=-1)
    accepted: list[bool] = []
    depth: list[int] = []
    best = -1
    for node, (token, parent) in enumerate(zip(draft_tokens, parents, strict=True)):
        parent_ok = parent < 0 or accepted[parent]
        accepted.append(parent_ok and int(token) == int(argmax[parent + 1]))
        depth.append(1 if parent < 0 else depth[parent] + 1)
        if accepted[node] and (best < 0 or depth[node] > depth[best]):
            best = node
    if best < 0:
        return 0, [], int(argmax[0])
    path = []
    node = best
    while node >= 0:
        path.append(node)
        node = int(parents[node])
    return len(path), path[::-1], int(argmax[best + 1])


def random_tree(
    num_nodes: int, vocab: int, generator: np.random.Generator, *, match_rate: float = 0.7
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(draft_tokens, parents, target_logits) of a random tree whose tokens often match."""
    parents = np.array(
        [int(generator.integers(-1, node)) if node else -1 for node in range(num_nodes)],
        dtype=np.int64,
    )
    logits = generator.standard_normal((num_nodes + 1, vocab)).astype(np.float32)
    argmax = logits.argmax(axis=-1)
    guesses = generator.integers(0, vocab, num_nodes)
    tokens = np.where(generator.random(num_nodes) < match_rate, argmax[parents + 1], guesses)
    return tokens.astype(np.int64), parents, logits


def verify_graph_parity(
    verifier: OnnxTreeVerifier, *, trees: int = 200, max_nodes: int = 48, seed: int = 0
) -> dict[str, Any]:
    """Compare the verify graph with `reference_greedy_verify` on random trees (exact match)."""
    generator = np.random.default_rng(seed)
    mismatches = []
    for index in range(trees):
        # Mix bushy random trees with long chains, the pointer-jumping worst case.
        n = int(generator.integers(0, max_nodes + 1))
        vocab = int(generator.integers(2, 9))
        tokens, parents, logits = random_tree(n, vocab, generator)
        if index % 5 == 0 and n:
            parents = np.arange(-1, n - 1, dtype=np.int64)
            tokens = np.where(generator.random(n) < 0.9, logits.argmax(-1)[parents + 1], tokens)
        expected = reference_greedy_verify(tokens.tolist(), parents.tolist(), logits)
        length, path, bonus = verifier.run(
            torch.from_numpy(tokens), torch.from_numpy(parents), torch.from_numpy(logits)
        )
        got = (length, path[:length].tolist(), bonus)
        padding_ok = bool((path[length:] == -1).all()) and path.shape[0] == n
        if got != expected or not padding_ok:
            mismatches.append({"tree": index, "expected": expected, "got": got})
    return {"trees": trees, "mismatches": len(mismatches), "examples": mismatches[:3]}


# ------------------------------------------------------------------------------------ rollouts
@torch.no_grad()
def rollout_parity(
    drafter: Eagle3Drafter,
    onnx_drafter: OnnxEagle3Drafter,
    *,
    features: Tensor | None = None,
    prompt_ids: Tensor | None = None,
    steps: int = 12,
    prompt_length: int = 8,
    seed: int = 0,
) -> dict[str, Any]:
    """Prefill from features, then greedy chain steps on the drafter's own hidden stream.

    `features` [1, L, F] are real target features when given (then `prompt_ids` [1, L] too);
    otherwise both are random. The PyTorch drafter's greedy tokens feed both runs; each run
    feeds back its own hidden states and keeps its own cache, as a decoder would.
    """
    from lightning_spec.export.onnx import export_ready

    model = export_ready(drafter)
    generator = torch.Generator().manual_seed(seed)
    real_features = features is not None
    if features is None:
        features = torch.randn(1, prompt_length, model.fc.in_features, generator=generator)
        vocab = model.target_vocab_size
        prompt_ids = torch.randint(0, vocab, (1, prompt_length), generator=generator)
    features = features.float().cpu()
    prompt_ids = prompt_ids.cpu()
    length = prompt_ids.shape[1]
    positions = torch.arange(length).unsqueeze(0)
    torch_state, onnx_state = model.new_state(1), onnx_drafter.new_state(1)
    ref = model.step(torch_state, prompt_ids, positions, features=features)
    got = onnx_drafter.step(onnx_state, prompt_ids, positions, features=features)
    worst = scale = 0.0

    def track(reference: Tensor, candidate: Tensor) -> None:
        nonlocal worst, scale
        diff, ref_scale = compare_outputs(reference, candidate.numpy())
        worst, scale = max(worst, diff), max(scale, ref_scale)

    track(ref.logits, got.logits)
    track(ref.hidden, got.hidden)
    hits, count = argmax_agreement(ref.logits, got.logits.numpy())
    for step in range(steps):
        draft_id = ref.logits[:, -1:].argmax(dim=-1)  # [1, 1] draft vocabulary
        token = draft_id + model.d2t[draft_id]  # target id
        position = torch.tensor([[length + step]])
        hidden_torch, hidden_onnx = ref.hidden[:, -1:], got.hidden[:, -1:]
        ref = model.step(torch_state, token, position, hidden=hidden_torch)
        got = onnx_drafter.step(onnx_state, token, position, hidden=hidden_onnx)
        track(ref.logits, got.logits)
        track(ref.hidden, got.hidden)
        step_hits, step_count = argmax_agreement(ref.logits, got.logits.numpy())
        hits, count = hits + step_hits, count + step_count
    track(torch_state.keys, onnx_state.keys)
    track(torch_state.values, onnx_state.values)
    return {
        "prefill_tokens": int(length),
        "steps": steps,
        "max_abs_diff": worst,
        "reference_scale": scale,
        "argmax_agreement": hits / max(count, 1),
        "real_features": real_features,
    }


@torch.no_grad()
def decode_parity(
    target: Any,
    drafter: Drafter,
    onnx_drafter: OnnxEagle3Drafter,
    verifier: OnnxTreeVerifier,
    prompts: Sequence[Sequence[int]],
    *,
    policies: Sequence[str] = ("chain:4", "dynamic:4,4,12"),
    max_new_tokens: int = 24,
    stop_on_eos: bool = False,
) -> dict[str, Any]:
    """Greedy `SpeculativeDecoder` runs, PyTorch vs onnxruntime, compared step by step."""
    from lightning_spec.decoding.build import parse_tree_spec
    from lightning_spec.decoding.engine import SpeculativeDecoder

    runs = []
    for spec in policies:
        policy = parse_tree_spec(spec)
        torch_decoder = SpeculativeDecoder(target, drafter, policy)
        onnx_decoder = SpeculativeDecoder(target, onnx_drafter, policy, greedy_verifier=verifier)
        for prompt_index, prompt in enumerate(prompts):
            expected = torch_decoder.generate(prompt, max_new_tokens, stop_on_eos=stop_on_eos)
            got = onnx_decoder.generate(prompt, max_new_tokens, stop_on_eos=stop_on_eos)
            same_trees = len(expected.records) == len(got.records) and all(
                torch.equal(a.tree.tokens, b.tree.tokens)
                and torch.equal(a.tree.parents, b.tree.parents)
                for a, b in zip(expected.records, got.records, strict=False)
            )
            runs.append(
                {
                    "policy": spec,
                    "prompt": prompt_index,
                    "tokens_equal": expected.tokens == got.tokens,
                    "trees_equal": same_trees,
                    "accept_lengths_equal": [r.accept_length for r in expected.records]
                    == [r.accept_length for r in got.records],
                    "new_tokens": len(got.tokens),
                    "tau_torch": expected.tau,
                    "tau_onnx": got.tau,
                }
            )
    return {
        "runs": runs,
        "tokens_equal": all(run["tokens_equal"] for run in runs),
        "trees_equal": all(run["trees_equal"] for run in runs),
        "accept_lengths_equal": all(run["accept_lengths_equal"] for run in runs),
    }


def parity_passed(result: dict[str, Any], tolerances: dict[str, float] | None = None) -> bool:
    """Whether a step/rollout parity result is within `tolerances`."""
    tolerances = tolerances or DEFAULT_TOLERANCES
    diff = result.get("max_abs_diff", math.inf)
    allowed = tolerances["atol"] + tolerances["rtol"] * result.get("reference_scale", 0.0)
    return bool(
        diff <= allowed
        and result.get("argmax_agreement", 0.0) >= tolerances["min_argmax_agreement"]
    )
