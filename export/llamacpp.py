"""Moved to `lightning_spec.tools.llamacpp`; this path warns and goes in the next release."""

import sys

from lightning_spec.deprecation import moved

if __name__ == "__main__":  # python -m lightning_spec.export.llamacpp ...
    sys.exit(moved("lightning_spec.export.llamacpp", "lightning_spec.tools.llamacpp").main())
sys.modules[__name__] = moved(__name__, "lightning_spec.tools.llamacpp")
