"""Moved into the command line: `lightning-spec bench llamacpp`."""

import shlex
import sys

new = shlex.join(["lightning-spec", "bench", *"llamacpp".split(), *sys.argv[1:]])
print(f"bench/llamacpp_bench.py moved: run `{new}`", file=sys.stderr)
sys.exit(2)
