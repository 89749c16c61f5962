"""Moved with its study: `python experiments/drafters/scripts/drafting_cost.py`."""

import shlex
import sys

new = shlex.join(["python", "experiments/drafters/scripts/drafting_cost.py", *sys.argv[1:]])
print(f"bench/drafting_cost.py moved: run `{new}`", file=sys.stderr)
sys.exit(2)
