"""Moved with its study: `python experiments/drafters/scripts/vocab_memory.py`."""

import shlex
import sys

new = shlex.join(["python", "experiments/drafters/scripts/vocab_memory.py", *sys.argv[1:]])
print(f"bench/vocab_memory.py moved: run `{new}`", file=sys.stderr)
sys.exit(2)
