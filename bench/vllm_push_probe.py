"""Moved with its study: `python experiments/engines/scripts/vllm_push_probe.py`."""

import shlex
import sys

new = shlex.join(["python", "experiments/engines/scripts/vllm_push_probe.py", *sys.argv[1:]])
print(f"bench/vllm_push_probe.py moved: run `{new}`", file=sys.stderr)
sys.exit(2)
