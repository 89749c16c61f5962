"""Moved to `lightning_spec.online.vllm_engine`; this path warns and goes in the next release."""

import sys

from lightning_spec.deprecation import moved

sys.modules[__name__] = moved(__name__, "lightning_spec.online.vllm_engine")
