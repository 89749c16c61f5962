"""Moved to `lightning_spec.tools.vllm`; this path warns and goes in the next release."""

import sys

from lightning_spec.deprecation import moved

if __name__ == "__main__":  # python -m lightning_spec.export.vllm ...
    sys.exit(moved("lightning_spec.export.vllm", "lightning_spec.tools.vllm").main())
sys.modules[__name__] = moved(__name__, "lightning_spec.tools.vllm")
