"""Moved into the command line: `lightning-spec bench plot`."""

import shlex
import sys

new = shlex.join(["lightning-spec", "bench", *"plot".split(), *sys.argv[1:]])
print(f"bench/plot_runs.py moved: run `{new}`", file=sys.stderr)
sys.exit(2)
