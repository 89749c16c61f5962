"""Moved into the command line: `lightning-spec bench pace --what sft-step`."""

import shlex
import sys

new = shlex.join(["lightning-spec", "bench", *"pace --what sft-step".split(), *sys.argv[1:]])
print(f"bench/sft_step_split.py moved: run `{new}`", file=sys.stderr)
sys.exit(2)
