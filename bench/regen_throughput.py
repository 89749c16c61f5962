"""Moved into the command line: `lightning-spec bench pace --what regen`."""

import shlex
import sys

new = shlex.join(["lightning-spec", "bench", *"pace --what regen".split(), *sys.argv[1:]])
print(f"bench/regen_throughput.py moved: run `{new}`", file=sys.stderr)
sys.exit(2)
