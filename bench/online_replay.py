"""Moved with its study: `python experiments/onlinespec/scripts/online_replay.py`."""

import shlex
import sys

new = shlex.join(["python", "experiments/onlinespec/scripts/online_replay.py", *sys.argv[1:]])
print(f"bench/online_replay.py moved: run `{new}`", file=sys.stderr)
sys.exit(2)
