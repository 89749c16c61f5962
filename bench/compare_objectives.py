"""Moved into the command line: `lightning-spec bench compare`."""

import shlex
import sys

new = shlex.join(["lightning-spec", "bench", *"compare".split(), *sys.argv[1:]])
print(f"bench/compare_objectives.py moved: run `{new}`", file=sys.stderr)
sys.exit(2)
