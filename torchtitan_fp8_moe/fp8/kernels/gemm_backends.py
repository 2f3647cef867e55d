"""The recipes' fp8 GEMMs behind one interface per GEMM form, with a backend per kernel library:
``torch`` (always there), ``fbgemm`` (fbgemm-gpu-genai's CUTLASS kernels) and ``deepgemm``
(DeepGEMM's sm90 kernels), each where installed for the running torch.

The rowwise forms (operands fp8 e4m3, scales fp32 multipliers, the inverses of the recipe's
scales; output bf16; fast accumulation):

- ``m_grouped(a [M, K], a_inv [M], b [G, K, N], b_inv [G, N], offs)`` -> ``[M, N]``: per group
  ``a_g @ b[g]``, the groups' rows ending at ``offs`` (int32). The forward and the input
  gradient. Rows past ``offs[-1]`` belong to no group and are left unwritten.
- ``k_grouped(a [P, M], a_inv [G * P], b [M, Q], b_inv [G * Q], offs)`` -> ``[G, P, Q]``: per
  group ``a[:, rows_g] @ b[rows_g]``, the weight gradient over each group's tokens.
- ``dense(a [M, K], a_inv [M, 1], b [K, N], b_inv [1, N])`` -> ``[M, N]``: one group (shared
  experts, linears).

``a`` is row-major; ``b`` is read with its contraction dim contiguous (column-major), as the
recipe's quantizers write it: any other layout is copied first.

The blockwise forms take the blockwise recipe's operands and scales as they are
(``fp8/recipes/blockwise/``; ``blockwise_gemm.py``'s contracts, output dtype last):
``blockwise_m_grouped(a, a_scale, b, b_scale, offs, out_dtype)`` (forward, input gradient) and
``blockwise_k_grouped(a, a_scale, grad, grad_scale, offs, out_dtype)`` (weight gradient).

A backend that lacks a form leaves it to another (``GemmChoice``); ``fbgemm`` has no fp8
weight-gradient (k-grouped) kernel and no blockwise one, ``deepgemm`` only blockwise ones. Which
backend runs each GEMM of a weight is the weight's ``GemmChoice``, made when it is converted
(``gemm_choice.py``).
"""

import logging
from dataclasses import dataclass

import torch

from ..gemm import column_major

logger = logging.getLogger(__name__)

ROWWISE_FORMS = ("m_grouped", "k_grouped", "dense")
BLOCKWISE_FORMS = ("blockwise_m_grouped", "blockwise_k_grouped")


@dataclass(frozen=True, order=True)
class GemmChoice:
    """The backend of each GEMM of one weight: forward, input gradient, weight gradient (the
    form follows from the weight: ``dense`` for one group, else ``m_grouped`` / ``k_grouped``)."""

    forward: str = "torch"
    input_grad: str = "torch"
    weight_grad: str = "torch"

    def describe(self) -> str:
        return (
            f"GEMMs forward {self.forward}, input grad {self.input_grad}, "
            f"weight grad {self.weight_grad}"
        )


# Every GEMM on torch's kernels: the default.
TORCH_GEMMS = GemmChoice()


class TorchBackend:
    """torch's ``_scaled_grouped_mm`` (CUTLASS) and ``_scaled_mm`` (cuBLAS); blockwise: torch's
    blockwise ``scaled_mm`` (cuBLAS) per group, or our Triton kernels (``blockwise_cublas.py``)."""

    name = "torch"
    forms = frozenset(ROWWISE_FORMS + BLOCKWISE_FORMS)

    def m_grouped(self, a, a_inv, b, b_inv, offs):
        return torch._scaled_grouped_mm(
            a,
            column_major(b),
            a_inv,
            b_inv,
            offs=offs,
            out_dtype=torch.bfloat16,
            use_fast_accum=True,
        )

    def k_grouped(self, a, a_inv, b, b_inv, offs):
        return self.m_grouped(a, a_inv, b, b_inv, offs)  # the same kernel, 2D x 2D

    def dense(self, a, a_inv, b, b_inv):
        return torch._scaled_mm(
            a,
            column_major(b),
            scale_a=a_inv,
            scale_b=b_inv,
            out_dtype=torch.bfloat16,
            use_fast_accum=True,
        )

    def blockwise_m_grouped(self, *operands):
        return _blockwise_kernels().blockwise_grouped_mm(*operands)

    def blockwise_k_grouped(self, *operands):
        return _blockwise_kernels().blockwise_grouped_mm_wgrad(*operands)


def _blockwise_kernels():
    """``blockwise_cublas.py`` (Triton: CUDA, and the interpreter, only)."""
    try:
        from . import blockwise_cublas
    except ImportError as e:
        raise NotImplementedError(
            'float8_moe: recipe "blockwise" has no CUDA GEMM kernels in this build '
            f"({type(e).__name__}: {e}); set `[float8_moe] emulate = true` to run it emulated, "
            'or recipe = "rowwise"'
        ) from e
    return blockwise_cublas


class FbgemmBackend:
    """fbgemm-gpu-genai's ``f8f8bf16_rowwise_grouped_stacked`` (m-grouped: weights ``[G, N, K]``
    with K contiguous, per-row and per-(group, column) scales, group sizes as int64) and
    ``f8f8bf16_rowwise`` (dense: ``[M, K] x [N, K]``). Its kernels read every operand as packed
    row-major storage, so each operand is made contiguous in that layout here."""

    name = "fbgemm"
    # fbgemm-gpu-genai 1.N is built for torch 2.(N+5).
    install = (
        "pip install fbgemm-gpu-genai==1.6.0 (for torch 2.11; 1.8.0 for torch 2.13: "
        "fbgemm-gpu-genai 1.N pairs with torch 2.(N+5))"
    )
    forms = frozenset({"m_grouped", "dense"})

    def __init__(self, ops):
        self.grouped = ops.f8f8bf16_rowwise_grouped_stacked
        self.gemm = ops.f8f8bf16_rowwise

    def m_grouped(self, a, a_inv, b, b_inv, offs):
        sizes = torch.diff(offs, prepend=offs.new_zeros(1)).to(torch.int64)
        return self.grouped(
            a.contiguous(),
            b.transpose(-2, -1).contiguous(),
            a_inv.contiguous(),
            b_inv.contiguous(),
            sizes,
        )

    def dense(self, a, a_inv, b, b_inv):
        return self.gemm(
            a.contiguous(),
            b.t().contiguous(),
            a_inv.reshape(-1).contiguous(),
            b_inv.reshape(-1).contiguous(),
            use_fast_accum=True,
        )


class DeepGemmBackend:
    """DeepGEMM's sm90 m-grouped and k-grouped fp8 kernels at the blockwise recipe's scale
    granularity (``blockwise_deepgemm.py``)."""

    name = "deepgemm"
    install = (
        "pip install --no-build-isolation deepinfer-gemm==2.8.2 (DeepGEMM built against the "
        "running torch: needs a CUDA toolkit, nvcc, and the elfutils headers libdw-dev; "
        "docs/gemm_backends.md)"
    )
    forms = frozenset(BLOCKWISE_FORMS)

    def __init__(self, kernels):
        self.blockwise_m_grouped = kernels.blockwise_grouped_mm
        self.blockwise_k_grouped = kernels.blockwise_grouped_mm_wgrad


def _load_deepgemm() -> DeepGemmBackend:
    """DeepGEMM's kernels; raises where it is not installed, not built for this torch, or the
    GPU is not sm90 (its fp32-scale kernels, the blockwise recipe's, are Hopper's)."""
    import deep_gemm

    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        raise RuntimeError(
            f"DeepGEMM's fp32-scale fp8 kernels need sm90, this GPU is sm{major}{minor}"
        )
    deep_gemm.get_num_sms()  # its runtime starts: a build for another torch fails here
    from . import blockwise_deepgemm

    return DeepGemmBackend(blockwise_deepgemm)


def _load_fbgemm() -> FbgemmBackend:
    """fbgemm-gpu-genai's kernels; raises where it is not installed, not built for this torch,
    or lacks them (AttributeError)."""
    import fbgemm_gpu.experimental.gen_ai  # noqa: F401  (registers torch.ops.fbgemm)

    return FbgemmBackend(torch.ops.fbgemm)


_LOADERS = {"fbgemm": _load_fbgemm, "deepgemm": _load_deepgemm}
_INSTALL = {"fbgemm": FbgemmBackend.install, "deepgemm": DeepGemmBackend.install}
BACKENDS = ("torch", *_LOADERS)
# ``[float8_moe] gemm_backend``: "auto" times the installed backends per GEMM (gemm_choice.py).
GEMM_BACKEND_OPTIONS = ("auto", *BACKENDS)

# Each backend once per process: loaded, or the exception its import raised. A plain dict, so
# compiled code reads it as a constant (``kernel``).
_loaded: dict[str, object] = {"torch": TorchBackend()}


def _load(name: str):
    if name not in _loaded:
        try:
            _loaded[name] = _LOADERS[name]()
        except Exception as e:  # noqa: BLE001 - a build for another torch raises anything
            _loaded[name] = e
            logger.info(
                f"float8_moe: GEMM backend {name} skipped, it does not load "
                f"({type(e).__name__}: {str(e)[:200]}); to use it: {_INSTALL[name]}"
            )
    return _loaded[name]


def available() -> list[str]:
    """The names of the backends that load here, ``torch`` first."""
    return [name for name in BACKENDS if not isinstance(_load(name), Exception)]


def backend(name: str):
    """The backend ``name``; raises naming the option and the install command where it does
    not load."""
    if name not in BACKENDS:
        raise ValueError(
            f"float8_moe: gemm_backend {name!r} is not one of {list(GEMM_BACKEND_OPTIONS)}"
        )
    loaded = _load(name)
    if isinstance(loaded, Exception):
        raise RuntimeError(
            f"float8_moe: gemm_backend = {name!r}, but {name} does not load here "
            f"({type(loaded).__name__}: {str(loaded)[:200]}); install it: {_INSTALL[name]}, "
            'or set float8_moe.gemm_backend = "auto" or "torch"'
        ) from loaded
    return loaded


def kernel(name: str):
    """The backend a converted weight's ``GemmChoice`` names, at call time (the conversion
    loaded it: a dict read, also in compiled code)."""
    loaded = _loaded.get(name)
    return loaded if loaded is not None and not isinstance(loaded, Exception) else backend(name)
