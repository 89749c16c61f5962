"""Compatibility path of `lightning_spec.registry.pyfunc.DrafterPyfunc`, kept for stored models.

Every drafter registered before the registry became a package carries, inside its MLflow model,
a copied `drafter_pyfunc.py` that runs `from lightning_spec.registry_pyfunc import
DrafterPyfunc` when the model is loaded or served (docs/registry.md, "What a model version
holds"). New versions import `lightning_spec.registry.pyfunc`. Remove this module once no store
holds a version registered with lightning-spec 0.1.0.
"""

from lightning_spec.registry.pyfunc import DrafterPyfunc

__all__ = ["DrafterPyfunc"]
