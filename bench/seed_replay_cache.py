"""Moved with its study: `python experiments/drafter-data/scripts/seed_replay_cache.py`."""

import shlex
import sys

new = shlex.join(["python", "experiments/drafter-data/scripts/seed_replay_cache.py", *sys.argv[1:]])
print(f"bench/seed_replay_cache.py moved: run `{new}`", file=sys.stderr)
sys.exit(2)
