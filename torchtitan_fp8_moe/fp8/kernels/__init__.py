"""Triton kernels of the fp8 casts (CUDA only; the tests also run them in Triton's interpreter).
Each follows the rules of ``fp8/quantize.py`` bit for bit; the recipes (``fp8/recipes/``) call
them through their CUDA quantizers: ``triton_rowwise.py``, ``triton_transposed.py`` and
``triton_per_group.py`` (rowwise), ``triton_blockwise.py`` (blockwise). The GEMMs:
``gemm_backends.py`` (rowwise: torch's or fbgemm's kernels, one interface per GEMM form),
``blockwise_cublas.py`` and ``blockwise_gemm.py`` (blockwise)."""
