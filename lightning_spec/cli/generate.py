"""`lightning-spec generate`: answer one prompt with speculative decoding and show what happened.

The smallest end-to-end use of the product: load a target (default: the embedded SmolLM2),
a drafter (a folder, `self`, `random` or `bigram:...`: the spellings of `lightning_spec.specs`),
decode a chat prompt, print the answer, tau, the time taken and whether the output equals the
target's own greedy decode (at T=0 it must).

``--drafter none`` decodes without a drafter, with our plain KV-cache loop; with ``--prepack``
(CPU fp32: the target's linear weights prepacked for oneDNN, `models.packed`) that alone is a
speedup over the default path, reported separately in RESULTS.md.
"""

from __future__ import annotations

import argparse
import time


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-spec generate", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--target", default="smollm2", help="hub id, model folder, .gguf, or smollm2"
    )
    parser.add_argument(
        "--drafter",
        default="self",
        help="drafter folder, `self` (target drafts for itself), `random` (untrained head), "
        "`bigram:<folder|data source>` or `none` (plain decoding, no drafter)",
    )
    parser.add_argument(
        "--prepack",
        action="store_true",
        help="CPU fp32: prepack the target's and drafter's linear weights for oneDNN (faster, "
        "same greedy output); skipped with a message where it cannot run",
    )
    parser.add_argument("--tree", default="chain:4", help="chain:K | static:NAME | dynamic:D,K,T")
    parser.add_argument("--prompt", default="Explain speculative decoding in two sentences.")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "fp32", "bf16", "bfloat16"]
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--text-format",
        default="auto",
        choices=["auto", "chat", "plain"],
        help="prompt rendering: the chat template (plain text for a base model without one), "
        "chat (a made-up role format without a template) or plain (see data.chat)",
    )
    parser.add_argument(
        "--no-check", action="store_true", help="skip the greedy comparison with the target"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from lightning_spec import specs
    from lightning_spec.data.chat import render_prompt
    from lightning_spec.decoding.engine import SpeculativeDecoder, autoregressive_generate

    torch.manual_seed(args.seed)
    target = specs.resolve_target(args.target, args.dtype)
    if target.tokenizer is not None:
        from lightning_spec.data.chat import set_text_format

        set_text_format(target.tokenizer, args.text_format)
    drafter = None if args.drafter == "none" else specs.resolve_drafter(args.drafter, target)
    if args.prepack:
        from lightning_spec.models.packed import prepack_where_possible

        prepack_where_possible({"target": target.model, "drafter": drafter}, who="generate")
    prompt = render_prompt(target.tokenizer, [{"role": "user", "content": args.prompt}])
    generator = torch.Generator().manual_seed(args.seed)
    if drafter is None:
        tic = time.perf_counter()
        tokens = autoregressive_generate(
            target, prompt, args.max_new_tokens, temperature=args.temperature, generator=generator
        )
        seconds = time.perf_counter() - tic
        print(target.tokenizer.decode(tokens, skip_special_tokens=True).strip())
        print(
            f"\n[{len(tokens)} tokens in {seconds:.2f} s ({len(tokens) / seconds:.1f} tok/s), "
            f"plain decoding, no drafter{', prepacked target' if args.prepack else ''}]"
        )
        return 0
    policy = specs.resolve_tree(args.tree)
    decoder = SpeculativeDecoder(target, drafter, policy, temperature=args.temperature)
    result = decoder.generate(prompt, args.max_new_tokens, generator=generator)
    print(target.tokenizer.decode(result.tokens, skip_special_tokens=True).strip())
    print(
        f"\n[{len(result.tokens)} tokens in {result.total_seconds:.2f} s, "
        f"{result.num_verifications} verifications, tau = "
        f"{'n/a' if not result.num_verifications else f'{result.tau:.2f}'} "
        f"(tokens committed per verification), drafter={args.drafter}, tree={args.tree}]"
    )
    if args.temperature == 0 and not args.no_check:
        tic = time.perf_counter()
        reference = autoregressive_generate(target, prompt, args.max_new_tokens)
        seconds = time.perf_counter() - tic
        same = reference == result.tokens
        print(
            f"[target greedy decode: {seconds:.2f} s; speculative output "
            f"{'equals' if same else 'DIFFERS FROM'} it]"
        )
        return 0 if same else 1
    return 0
