"""Moved into the command line: `lightning-spec bench vocab`."""

import shlex
import sys

new = shlex.join(["lightning-spec", "bench", *"vocab".split(), *sys.argv[1:]])
print(f"bench/vocab_coverage.py moved: run `{new}`", file=sys.stderr)
sys.exit(2)
