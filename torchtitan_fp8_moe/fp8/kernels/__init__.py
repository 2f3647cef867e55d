"""Triton kernels of the fp8 casts (CUDA only; the tests also run them in Triton's interpreter).
Each follows the rules of ``fp8/quantize.py`` bit for bit; the recipes (``fp8/recipes/``) call
them through their CUDA quantizers."""
