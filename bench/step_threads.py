"""Moved with its study: `python experiments/onlinespec/scripts/step_threads.py`."""

import shlex
import sys

new = shlex.join(["python", "experiments/onlinespec/scripts/step_threads.py", *sys.argv[1:]])
print(f"bench/step_threads.py moved: run `{new}`", file=sys.stderr)
sys.exit(2)
