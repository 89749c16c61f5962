"""Moved with its study: `python experiments/gto-draft-opd/scripts/gto_sign_test.py`."""

import shlex
import sys

new = shlex.join(["python", "experiments/gto-draft-opd/scripts/gto_sign_test.py", *sys.argv[1:]])
print(f"bench/gto_sign_test.py moved: run `{new}`", file=sys.stderr)
sys.exit(2)
