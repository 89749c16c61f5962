"""Moved with its study: `python experiments/onlinespec/scripts/vllm_beside_probe.py`."""

import shlex
import sys

new = shlex.join(["python", "experiments/onlinespec/scripts/vllm_beside_probe.py", *sys.argv[1:]])
print(f"bench/vllm_beside_probe.py moved: run `{new}`", file=sys.stderr)
sys.exit(2)
