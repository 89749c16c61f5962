"""Moved into the command line: `lightning-spec bench online`."""

import shlex
import sys

new = shlex.join(["lightning-spec", "bench", *"online".split(), *sys.argv[1:]])
print(f"bench/online_compare.py moved: run `{new}`", file=sys.stderr)
sys.exit(2)
