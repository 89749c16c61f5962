"""Moved to `lightning_spec.online.overlap`; this path warns and goes in the next release."""

import sys

from lightning_spec.deprecation import moved

if __name__ == "__main__":  # python -m lightning_spec.serving.overlap ...
    sys.exit(moved("lightning_spec.serving.overlap", "lightning_spec.online.overlap").main())
sys.modules[__name__] = moved(__name__, "lightning_spec.online.overlap")
