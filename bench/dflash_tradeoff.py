"""Moved with its study: `python experiments/drafters/scripts/dflash_tradeoff.py`."""

import shlex
import sys

new = shlex.join(["python", "experiments/drafters/scripts/dflash_tradeoff.py", *sys.argv[1:]])
print(f"bench/dflash_tradeoff.py moved: run `{new}`", file=sys.stderr)
sys.exit(2)
