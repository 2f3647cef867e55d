"""CPU support for torchtitan 0.2.2, which assumes CUDA. Only for machines without CUDA:
``enable_cpu_training()`` refuses to run where CUDA is present, and the MoE op wrappers pass
CUDA tensors to the original code unchanged.

Device: torchtitan picks its device type once, at import, and falls back to "cuda" when no
accelerator is found. ``select_cpu_device()`` points the modules that captured it at the CPU.

MoE (``enable_moe_ops()``): torchtitan's MoE assumes CUDA in two places, and the experts keep
the grouped-mm path on CPU: the router counts tokens per expert with ``torch.histc`` on int64
indices (CPU has no integer histc kernel), and the token-group padding builds its permutation
with a Triton kernel unless asked for its CPU implementation.
bf16 GEMMs (``use_fp32_gemms_for_bf16()``): on CPUs without AVX512-BF16 / AMX, torch's bf16 matmuls
run a reference loop far slower than fp32's kernels (plain and grouped mm alike; see docs/cpu.md),
which made a bf16 trainer step on CPU mostly GEMM time. The trainer's CPU mode runs them as fp32
GEMMs of the bf16 values, rounded to bf16: the products of bf16 values are exact in fp32 and both
kernels accumulate in fp32, so only the summation order differs.
"""

import functools
import importlib
import logging
import os
import resource
import sys
import warnings

import torch
from torchtitan.tools.logging import logger

# torchtitan modules that bind the device type / module at import time.
_DEVICE_GLOBALS = {
    "torchtitan.tools.utils": ("device_type", "device_module"),
    "torchtitan.tools.profiling": ("device_module",),
    "torchtitan.components.metrics": ("device_type", "device_module"),
    "torchtitan.distributed.parallel_dims": ("device_type",),
    "torchtitan.distributed.utils": ("device_type", "device_module"),
}
# torchtitan model args that switch the experts to the for-loop path without CUDA SM90.
_MODEL_ARGS_MODULES = (
    "torchtitan.models.llama4.model.args",
    "torchtitan.models.deepseek_v3.model.args",
    "torchtitan.models.gpt_oss.model.args",
)
_original_histc = torch.histc
_original_generate_permute_indices = None  # torchtitan 0.2.2's, set by enable_moe_ops
_original_disable_division = None


@functools.wraps(_original_histc)
def _histc(input: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    if input.device.type == "cpu" and not input.is_floating_point():
        return _original_histc(input.float(), *args, **kwargs).to(input.dtype)
    return _original_histc(input, *args, **kwargs)


def _generate_permute_indices(tokens_per_expert_group, *args, **kwargs):
    if tokens_per_expert_group.device.type == "cpu":
        kwargs["use_cpu"] = True
    return _original_generate_permute_indices(tokens_per_expert_group, *args, **kwargs)


_original_grouped_mm = torch._grouped_mm
# aten GEMMs whose CPU kernels are replaced, each computed through its ``out`` overload (which
# keeps torch's kernel).
_BF16_GEMMS = ("mm", "addmm", "bmm", "baddbmm")
_gemm_library = None


def _all_bf16(tensors) -> bool:
    return all(t.dtype == torch.bfloat16 for t in tensors if isinstance(t, torch.Tensor))


def _gemm_through_fp32(name: str):
    out_overload = getattr(torch.ops.aten, name).out

    def gemm(*args, **kwargs):
        first = next(a for a in args if isinstance(a, torch.Tensor))
        if not _all_bf16(args):
            # An empty ``out`` is resized by the kernel: the plain op's result.
            return out_overload(*args, **kwargs, out=first.new_empty(0))
        fp32_args = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
        out = out_overload(*fp32_args, **kwargs, out=first.new_empty(0, dtype=torch.float32))
        return out.to(torch.bfloat16)

    return gemm


@functools.wraps(_original_grouped_mm)
def _grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    # Plain bf16 CPU tensors only: a converted weight (a subclass) takes its own path, and under
    # torch.compile the call stays bf16 (the compiler's shape rule for _grouped_mm takes bf16
    # only; compiled code runs its own kernel call anyway).
    if (
        torch.compiler.is_compiling()
        or type(mat_a) is not torch.Tensor
        or type(mat_b) is not torch.Tensor
        or mat_a.device.type != "cpu"
        or mat_a.dtype != torch.bfloat16
        or mat_b.dtype != torch.bfloat16
        or bias is not None
        or out_dtype not in (None, torch.bfloat16)
    ):
        return _original_grouped_mm(mat_a, mat_b, offs=offs, bias=bias, out_dtype=out_dtype)
    return _original_grouped_mm(mat_a.float(), mat_b.float(), offs=offs).to(torch.bfloat16)


def use_fp32_gemms_for_bf16() -> None:
    """Run bf16 mm / addmm / bmm / baddbmm and ``torch._grouped_mm`` on CPU tensors as fp32
    GEMMs rounded to bf16 (see the module docstring; idempotent). Process-wide: only for the
    trainer's CPU mode, never where CUDA is present."""
    global _gemm_library
    if _gemm_library is not None:
        return
    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Overriding a previously registered kernel")
        for name in _BF16_GEMMS:
            library.impl(name, _gemm_through_fp32(name), "CPU")
    torch._grouped_mm = _grouped_mm
    _gemm_library = library


def select_cpu_device(device_globals: dict[str, tuple[str, ...]] = _DEVICE_GLOBALS) -> None:
    """Make torchtitan use the CPU (``torch.cpu``) as its device: ``device_globals`` names the
    modules that bound the device at import, and the names they bound (default: 0.2.2's)."""
    values = {"device_type": "cpu", "device_module": torch.cpu}
    for module_name, names in device_globals.items():
        module = importlib.import_module(module_name)
        for name in names:
            setattr(module, name, values[name])
    logger.info("running on CPU: torchtitan's device is set to cpu (no CUDA device found)")


def enable_moe_ops() -> None:
    """Make torchtitan's MoE routing and token padding run on CPU tensors (idempotent)."""
    global _original_generate_permute_indices
    from torchtitan.models.moe import utils as moe_utils

    if torch.histc is _histc:
        return
    torch.histc = _histc
    _original_generate_permute_indices = moe_utils.generate_permute_indices
    moe_utils.generate_permute_indices = _generate_permute_indices
    logger.info(
        "running on CPU: integer torch.histc is computed in float32 and MoE token-group "
        "padding uses torchtitan's CPU permutation, for CPU tensors only"
    )


def use_sum_reductions(model: torch.nn.Module) -> None:
    """Make FSDP2 reduce gradients with plain sums on gloo.

    torchtitan sets a gradient divide factor of 1 (it scales the loss by the global token count
    itself), which FSDP2 runs as ``ReduceOp.PREMUL_SUM``; gloo has no such op. Forcing sum
    reductions gives the same gradients: a sum, scaled by 1.
    """
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


class CpuMemoryMonitor:
    """torchtitan's device memory monitor for the CPU: peak resident set size of the process."""

    def __init__(self):
        self.device_name = "cpu"
        self.device_capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        self.device_capacity_gib = self.device_capacity / 2**30

    def get_peak_stats(self):
        from torchtitan.components.metrics import DeviceMemStats

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        pct = 100 * peak / self.device_capacity
        return DeviceMemStats(peak / 2**30, pct, peak / 2**30, pct, 0, 0)

    def reset_peak_stats(self):
        pass  # the kernel's peak RSS cannot be reset


# torch.distributed.set_timeout where torch has it (2.15 does, and deprecates the private
# _set_pg_timeout); torch 2.11-2.13 have only the private one (torch_private.py).
_set_timeout = getattr(torch.distributed, "set_timeout", None) or (
    torch.distributed.distributed_c10d._set_pg_timeout
)


def _set_pg_timeouts(timeout, parallel_dims) -> None:
    """torchtitan's set_pg_timeouts without its CUDA barrier (gloo rejects ``device_ids``)."""
    torch.distributed.barrier()
    groups = [m.get_group() for m in parallel_dims.get_all_one_dimensional_meshes().values()]
    for group in groups + [None]:
        # torchtitan gives the mesh dims of degree 1 torch's "fake" backend: no collective runs
        # there, and torch warns that it cannot set its timeout.
        if group is not None and torch.distributed.get_backend(group) == "fake":
            continue
        _set_timeout(timeout, group)


_original_destroy_process_group = torch.distributed.destroy_process_group


def _exit_after_training(group=None) -> None:
    """Stands in for ``destroy_process_group``, which torchtitan calls once training succeeded:
    every rank meets at a barrier, then the process exits with status 0 without tearing gloo
    down. In CI, about one trainer run in ten had a rank abort (SIGABRT, "terminate called
    without an active exception") in gloo's teardown after the last step, with or without a
    barrier first; nothing is left to do at this point, so the teardown is skipped."""
    if group is None and torch.distributed.is_initialized():
        torch.distributed.barrier()
        logger.info("CPU mode: all ranks finished; exiting without gloo teardown")
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        logging.shutdown()
        os._exit(0)
    _original_destroy_process_group(group)


def _disable_fsdp_gradient_division_with_sums(model: torch.nn.Module) -> None:
    _original_disable_division(model)
    use_sum_reductions(model)


def enable_cpu_training() -> None:
    """Everything torchtitan 0.2.2's trainer needs to train Llama4 on CPU with gloo. Call it
    after importing torchtitan and before building the Trainer; only on machines without CUDA."""
    global _original_disable_division
    if torch.cuda.is_available():
        raise RuntimeError("float8_moe: CPU training mode on a machine with CUDA")
    from torchtitan.components import metrics
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.llama4.infra import parallelize

    select_cpu_device()
    enable_moe_ops()
    use_fp32_gemms_for_bf16()
    metrics.build_device_memory_monitor = CpuMemoryMonitor
    dist_utils.set_pg_timeouts = _set_pg_timeouts
    torch.distributed.destroy_process_group = _exit_after_training
    _original_disable_division = parallelize.disable_fsdp_gradient_division
    parallelize.disable_fsdp_gradient_division = _disable_fsdp_gradient_division_with_sums
    # torch._grouped_mm runs on CPU: keep the experts on the grouped path the GPU takes (each
    # model's args fall back to a per-expert for-loop below SM90).
    for args_module in _MODEL_ARGS_MODULES:
        importlib.import_module(args_module).has_cuda_capability = lambda major, minor: True
    logger.info(
        "running on CPU: gloo backend, emulated fp8, experts on the grouped-mm path; "
        "memory is the process's peak RSS; FSDP reduces gradients with sums (gloo has no "
        "PREMUL_SUM); process-group timeouts are set without a CUDA barrier; after training "
        "the ranks meet at a barrier and exit without gloo teardown; bf16 GEMMs run as fp32 "
        "GEMMs rounded to bf16"
    )
