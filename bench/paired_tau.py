"""Moved into the command line: `lightning-spec bench paired`."""

import shlex
import sys

new = shlex.join(["lightning-spec", "bench", *"paired".split(), *sys.argv[1:]])
print(f"bench/paired_tau.py moved: run `{new}`", file=sys.stderr)
sys.exit(2)
