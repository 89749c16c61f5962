"""Session-wide test setup.

TRITON_INTERPRET must be set before anything imports triton (lightning does, at collection
time), so it lives here rather than in tests/kernels: on a machine without CUDA the Triton
kernels then run in the interpreter, on CPU.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tests run tiny models, for which one thread is fastest and steadiest; real-model tests that
# want more set LIGHTNING_SPEC_TEST_THREADS.
torch.set_num_threads(int(os.environ.get("LIGHTNING_SPEC_TEST_THREADS", "1")))
