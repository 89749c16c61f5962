"""Session-wide test setup.

TRITON_INTERPRET must be set before anything imports triton (lightning does, at collection
time), so it lives here rather than in tests/kernels: on a machine without CUDA the Triton
kernels then run in the interpreter, on CPU.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tests run tiny models, for which one thread is fastest and steadiest (and two processes on
# shared cores do not oversubscribe OpenMP); real-model tests that want more set
# LIGHTNING_SPEC_TEST_THREADS.
TEST_THREADS = int(os.environ.get("LIGHTNING_SPEC_TEST_THREADS", "1"))
torch.set_num_threads(TEST_THREADS)


@pytest.fixture(autouse=True)
def _test_threads():
    """Re-pin the thread count around every test: code under test (bench) may change it."""
    torch.set_num_threads(TEST_THREADS)
    yield
    torch.set_num_threads(TEST_THREADS)
