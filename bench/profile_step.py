"""Moved into the command line: `lightning-spec bench profile`."""

import shlex
import sys

new = shlex.join(["lightning-spec", "bench", *"profile".split(), *sys.argv[1:]])
print(f"bench/profile_step.py moved: run `{new}`", file=sys.stderr)
sys.exit(2)
