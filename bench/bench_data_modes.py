"""Moved with its study: `python experiments/drafters/scripts/bench_data_modes.py`."""

import shlex
import sys

new = shlex.join(["python", "experiments/drafters/scripts/bench_data_modes.py", *sys.argv[1:]])
print(f"bench/bench_data_modes.py moved: run `{new}`", file=sys.stderr)
sys.exit(2)
