"""Moved with its study: `python experiments/gto-draft-opd/scripts/rollout_replay.py`."""

import shlex
import sys

new = shlex.join(["python", "experiments/gto-draft-opd/scripts/rollout_replay.py", *sys.argv[1:]])
print(f"bench/rollout_replay.py moved: run `{new}`", file=sys.stderr)
sys.exit(2)
