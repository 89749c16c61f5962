"""Moved into the command line: `lightning-spec bench pace --what features`."""

import shlex
import sys

new = shlex.join(["lightning-spec", "bench", *"pace --what features".split(), *sys.argv[1:]])
print(f"bench/feature_throughput.py moved: run `{new}`", file=sys.stderr)
sys.exit(2)
