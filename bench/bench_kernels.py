"""Moved into the command line: `lightning-spec bench kernels`."""

import shlex
import sys

new = shlex.join(["lightning-spec", "bench", *"kernels".split(), *sys.argv[1:]])
print(f"bench/bench_kernels.py moved: run `{new}`", file=sys.stderr)
sys.exit(2)
