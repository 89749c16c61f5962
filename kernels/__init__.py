"""Triton kernels for tree speculative decoding, each beside the PyTorch reference it must match.

* ``tree_attention``: N draft-tree queries over a KV cache plus the tree under its ancestor
  mask (``ancestor_mask`` builds that mask from parent indices).
* ``tree_verify`` / ``tree_verify_batched``: greedy acceptance of the longest draft path.

Every wrapper falls back to its reference when Triton is missing or cannot run on the tensors'
device (CPU without ``TRITON_INTERPRET=1`` set before import), so importing this package never
fails for want of Triton; ``TRITON_AVAILABLE`` says which case holds. This package imports
nothing else from lightning_spec, so it can be copied or benchmarked on its own.
"""

import importlib

import torch

from .tree_attention import (
    TRITON_AVAILABLE,
    ancestor_mask,
    tree_attention,
    tree_attention_reference,
)
from .tree_verify import (
    tree_verify,
    tree_verify_batched,
    tree_verify_batched_reference,
    tree_verify_reference,
)

__all__ = [
    "TRITON_AVAILABLE",
    "triton_unavailable_reason",
    "ancestor_mask",
    "tree_attention",
    "tree_attention_reference",
    "tree_verify",
    "tree_verify_batched",
    "tree_verify_batched_reference",
    "tree_verify_reference",
]


def triton_unavailable_reason(device: torch.device | str = "cpu") -> str:
    """Why the Triton kernels cannot run on `device` in this process ("" when they can).

    On CPU they run only through Triton's interpreter, which must have been switched on
    (TRITON_INTERPRET=1) before triton was first imported; the kernel objects know.
    """
    if not TRITON_AVAILABLE:
        return "triton is not importable: only the PyTorch reference runs"
    if torch.device(device).type == "cuda":
        return ""
    modules = [
        importlib.import_module(f"{__name__}.{name}") for name in ("tree_attention", "tree_verify")
    ]
    if not all(module._kernels_interpreted() for module in modules):
        return (
            "triton was imported before TRITON_INTERPRET=1 was set (tests/conftest.py sets it), "
            "so its kernels cannot run on CPU in this process"
        )
    return ""


def _yield_the_top_level_name() -> None:
    """This folder installs as ``lightning_spec.kernels``, but Python run from the repository
    root also finds it under the top-level name ``kernels``, which is Hugging Face's kernels
    package (transformers >= 5.25 installs it and imports it when it is present): a model load
    from the repository root then got this package and failed. Imported under that name, hand
    the name to the installed package when there is one (else nothing else claims it)."""
    import importlib.machinery
    import importlib.util
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec("kernels", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module  # what `import kernels` returns once this file has run
    spec.loader.exec_module(module)


if __name__ == "kernels":
    _yield_the_top_level_name()
