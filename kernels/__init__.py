"""Tandem's compute kernels.

``kernels.reference`` holds the PyTorch implementations (the CPU path and the test
oracle); ``kernels.triton_*`` hold the Triton kernels for CUDA. Importing this package
does nothing else: Hugging Face transformers probes a top-level module named
``kernels``, so this file must stay free of side effects and heavy imports.
"""
