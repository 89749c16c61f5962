"""Moved with its study: `python experiments/onlinespec/scripts/engine_vs_greedy.py`."""

import shlex
import sys

new = shlex.join(["python", "experiments/onlinespec/scripts/engine_vs_greedy.py", *sys.argv[1:]])
print(f"bench/engine_vs_greedy.py moved: run `{new}`", file=sys.stderr)
sys.exit(2)
