"""lightning-spec: train, adapt, evaluate and ship speculative-decoding drafters.

Imports here stay light on purpose: `lightning-spec --help` must answer fast, so heavy
libraries (mlflow, onnx, triton, transformers) are imported where they are used.
"""

__version__ = "0.1.0"
