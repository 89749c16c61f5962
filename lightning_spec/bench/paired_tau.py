"""Paired tau comparisons between the drafters of one bench run (same prompts, same run).

For every pair (method A vs method B) and every dataset plus the pooled set: the pooled tau of
each (committed tokens / verifications), the relative gain A/B - 1 with a 95% bootstrap interval
resampling prompts (the same prompts for both: a paired bootstrap), and the mean per-prompt tau
difference with its interval. A gain counts only when its interval excludes 0.

    lightning-spec bench paired RESULT.json --pair speculative:gto/drafter,speculative:sft_control/drafter

`--merge OTHER.json` adds the drafters of another bench run on the same prompts, for a drafter
benched in an earlier session. Only at T = 0, where tau is a deterministic function of drafter,
target and prompt: the two runs must agree on target, tree, max new tokens and prompts, at least
one method must be benched in both, and every such method must have made exactly the same tokens
and acceptance lengths on every prompt (the check that the merge is sound); anything else is
refused.

`--seed-run OTHER.json` pools another run of the same bench at another seed (T > 0: sampled
acceptance varies with the draws). Every setting but the seed must agree, with the same prompts
and methods; each prompt's committed tokens and verifications are summed over the seeds, so
the bootstrap still resamples prompts (a prompt's seeds stay together) and a prompt counts once.

`--merge-text OTHER.json` is for a run whose drafters no longer exist (an asset cache lost with
its machine): no method need be benched in both, and the check is the text itself. At T = 0
every method of a run decodes the target's greedy text, so the two runs are paired prompt by
prompt where their greedy tokens are identical; a prompt whose text differs (a near-tie the two
machines' arithmetic broke differently) is left out of the pairing and counted. `--rename
OLD=NEW` renames a merged method (two runs that both call their drafter `speculative:drafter`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from lightning_spec import stats


def _gain_of(
    a_num: torch.Tensor, a_den: torch.Tensor, b_num: torch.Tensor, b_den: torch.Tensor
) -> torch.Tensor:
    return (a_num.sum(-1) / a_den.sum(-1)) / (b_num.sum(-1) / b_den.sum(-1)) - 1


def compare(result: dict[str, Any], a: str, b: str, resamples: int = 2000) -> dict[str, Any]:
    """The paired comparison of methods `a` and `b` (see the module docstring)."""
    groups: dict[str, list[dict[str, Any]]] = {"pooled": list(result["per_prompt"])}
    for entry in result["per_prompt"]:
        groups.setdefault(entry["dataset"], []).append(entry)
    out: dict[str, Any] = {}
    for name, entries in groups.items():
        rows = [
            (e["methods"][a], e["methods"][b])
            for e in entries
            if a in e["methods"] and b in e["methods"]
        ]
        rows = [(x, y) for x, y in rows if x.get("verifications") and y.get("verifications")]
        if not rows:
            continue
        a_num = [float(x["committed_by_verification"]) for x, _ in rows]
        a_den = [float(x["verifications"]) for x, _ in rows]
        b_num = [float(y["committed_by_verification"]) for _, y in rows]
        b_den = [float(y["verifications"]) for _, y in rows]
        tau_a, tau_b = sum(a_num) / sum(a_den), sum(b_num) / sum(b_den)
        per_prompt = [
            n1 / d1 - n2 / d2 for n1, d1, n2, d2 in zip(a_num, a_den, b_num, b_den, strict=True)
        ]
        out[name] = {
            "prompts": len(rows),
            "tau_a": tau_a,
            "tau_b": tau_b,
            "gain": tau_a / tau_b - 1,
            "gain_ci": stats.bootstrap_ci(
                (a_num, a_den, b_num, b_den), _gain_of, resamples=resamples
            ),
            "mean_difference": sum(per_prompt) / len(per_prompt),
            "mean_difference_ci": stats.bootstrap_ci(per_prompt, resamples=resamples),
        }
    return out


_MUST_AGREE = ("target", "tree", "max_new_tokens", "temperature", "dtype", "stop_on_eos")


Entries = dict[tuple[str, str], dict[str, Any]]


def _pairable(result: dict[str, Any], other: dict[str, Any]) -> tuple[Entries, Entries]:
    """Both runs' per-prompt entries by (dataset, id), once the runs are shown comparable: the
    same settings (`_MUST_AGREE`), T = 0 and the same prompts; else ValueError saying why."""
    _check_agree(result, other, "merge", greedy=True)
    return _by_prompt(result), _by_prompt(other)


def _by_prompt(result: dict[str, Any]) -> Entries:
    return {(e["dataset"], e["id"]): e for e in result["per_prompt"]}


def _check_agree(result: dict[str, Any], other: dict[str, Any], what: str, *, greedy: bool) -> None:
    """ValueError ("cannot `what`: ...") unless the runs share `_MUST_AGREE` and their prompts
    (and, with `greedy`, were run at T = 0)."""
    for key in _MUST_AGREE:
        if result["config"].get(key) != other["config"].get(key):
            raise ValueError(
                f"cannot {what}: {key} differs ({result['config'].get(key)!r} vs "
                f"{other['config'].get(key)!r})"
            )
    if greedy and float(result["config"].get("temperature", 1.0)) != 0.0:
        raise ValueError(f"cannot {what}: only T = 0 runs are deterministic enough to pair")
    if _by_prompt(result).keys() != _by_prompt(other).keys():
        raise ValueError(f"cannot {what}: the two runs benched different prompts")


def merge(result: dict[str, Any], other: dict[str, Any]) -> list[str]:
    """Add `other`'s methods to `result` in place (module docstring); the methods added."""
    mine, theirs = _pairable(result, other)
    shared = set(result["config"]["methods"]) & set(other["config"]["methods"])
    if not shared:
        raise ValueError(
            "cannot merge: no method was benched in both runs, so nothing shows they decode alike"
        )
    added: list[str] = []
    for key, entry in mine.items():
        for method, record in theirs[key]["methods"].items():
            if method not in shared:
                entry["methods"][method] = record
                if method not in added:
                    added.append(method)
                continue
            ours = entry["methods"][method]
            if (ours["tokens"], ours["accept_lengths"]) != (
                record["tokens"],
                record["accept_lengths"],
            ):
                raise ValueError(
                    f"cannot merge: {method} decoded {key} differently in the two runs"
                )
    return added


def pool_seeds(result: dict[str, Any], other: dict[str, Any]) -> None:
    """Sum `other`'s counts into `result` prompt by prompt (module docstring, --seed-run)."""
    _check_agree(result, other, "pool seeds", greedy=False)
    seed = other["config"].get("seed")
    if seed in _seeds(result):
        raise ValueError(f"cannot pool seeds: both runs used seed {seed}")
    if sorted(result["config"]["methods"]) != sorted(other["config"]["methods"]):
        raise ValueError("cannot pool seeds: the two runs benched different methods")
    theirs = _by_prompt(other)
    for entry in result["per_prompt"]:
        for method, record in entry["methods"].items():
            if not record.get("verifications"):
                continue
            extra = theirs[(entry["dataset"], entry["id"])]["methods"][method]
            for field in ("committed_by_verification", "verifications"):
                record[field] = record[field] + extra[field]
            record["tau"] = record["committed_by_verification"] / record["verifications"]
    result["config"]["seed"] = [*_seeds(result), seed]


def _seeds(result: dict[str, Any]) -> list[Any]:
    seed = result["config"].get("seed")
    return list(seed) if isinstance(seed, list) else [seed]


def _text_of(entry: dict[str, Any]) -> list[int] | None:
    """The greedy tokens of a T = 0 per-prompt entry (every method's are the same)."""
    for record in entry["methods"].values():
        if record.get("tokens") is not None:
            return list(record["tokens"])
    return None


def merge_text(
    result: dict[str, Any], other: dict[str, Any], rename: dict[str, str] | None = None
) -> tuple[list[str], list[str]]:
    """Add `other`'s methods to `result` in place where both decoded the same greedy text
    (module docstring); returns (methods added, prompt ids left out because the text differs).
    Prompts left out lose every method of both runs, so each pair is compared on one set."""
    mine, theirs = _pairable(result, other)
    rename = rename or {}
    added: list[str] = []
    differs: list[str] = []
    kept = []
    for key, entry in mine.items():
        text = _text_of(entry)
        if text is None or text != _text_of(theirs[key]):
            differs.append(key[1])
            continue
        for method, record in theirs[key]["methods"].items():
            name = rename.get(method, method)
            if name in entry["methods"]:
                raise ValueError(
                    f"cannot merge: both runs have {name}; rename one with --rename {name}=NEW"
                )
            entry["methods"][name] = record
            if name not in added:
                added.append(name)
        kept.append(entry)
    result["per_prompt"] = kept
    return added, differs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-spec bench paired", description=__doc__.splitlines()[0])
    parser.add_argument("result", type=Path)
    parser.add_argument("--pair", action="append", required=True, help="METHOD_A,METHOD_B")
    parser.add_argument(
        "--merge",
        type=Path,
        action="append",
        default=[],
        help="another T = 0 bench run on the same prompts (module docstring)",
    )
    parser.add_argument(
        "--merge-text",
        type=Path,
        action="append",
        default=[],
        help="a T = 0 run paired where its greedy text is the same (module docstring)",
    )
    parser.add_argument(
        "--seed-run",
        type=Path,
        action="append",
        default=[],
        help="the same bench at another seed, pooled per prompt (module docstring)",
    )
    parser.add_argument("--rename", action="append", default=[], help="OLD=NEW, merged methods")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    result = json.loads(args.result.read_text())
    for path in args.merge:
        added = merge(result, json.loads(path.read_text()))
        print(f"merged from {path}: {', '.join(added) or 'nothing new'}", file=sys.stderr)
    for path in args.seed_run:
        pool_seeds(result, json.loads(path.read_text()))
    rename = dict(item.split("=", 1) for item in args.rename)
    report: dict[str, Any] = {"seeds": _seeds(result)}
    for path in args.merge_text:
        added, differs = merge_text(result, json.loads(path.read_text()), rename)
        print(
            f"merged from {path} on identical greedy text: {', '.join(added) or 'nothing new'}; "
            f"{len(differs)} prompts left out (text differs)",
            file=sys.stderr,
        )
        report[f"text merge {path.name}"] = {"added": added, "left_out": differs}
    for pair in args.pair:
        a, b = pair.split(",")
        report[f"{a} vs {b}"] = compare(result, a, b)
    text = json.dumps(report, indent=1)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")
    return 0

