"""Moved with its study: `python experiments/gto-draft-opd/scripts/objective_step_cost.py`."""

import shlex
import sys

new = shlex.join(["python", "experiments/gto-draft-opd/scripts/objective_step_cost.py", *sys.argv[1:]])
print(f"bench/objective_step_cost.py moved: run `{new}`", file=sys.stderr)
sys.exit(2)
