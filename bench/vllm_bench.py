"""Moved into the command line: `lightning-spec bench vllm`."""

import shlex
import sys

new = shlex.join(["lightning-spec", "bench", *"vllm".split(), *sys.argv[1:]])
print(f"bench/vllm_bench.py moved: run `{new}`", file=sys.stderr)
sys.exit(2)
