"""CPU support for torchtitan 0.2.2, which assumes CUDA; every function here is a no-op for CUDA.

Device: torchtitan picks its device type once, at import, and falls back to "cuda" when no
accelerator is found. ``select_cpu_device()`` points the modules that captured it at the CPU.

MoE: torchtitan's MoE assumes CUDA in two places, and the experts keep the grouped-mm path on CPU: the router counts tokens per expert with
``torch.histc`` on int64 indices (CPU has no integer histc kernel), and the token-group padding
builds its permutation with a Triton kernel unless asked for its CPU implementation. ``enable()``
fixes both for CPU tensors only; CUDA tensors take the original code unchanged.
"""

import functools
import importlib

import torch
from torchtitan.models.moe import utils as moe_utils
from torchtitan.tools.logging import logger

# torchtitan modules that bind the device type / module at import time.
_DEVICE_GLOBALS = {
    "torchtitan.tools.utils": ("device_type", "device_module"),
    "torchtitan.tools.profiling": ("device_module",),
    "torchtitan.components.metrics": ("device_type", "device_module"),
    "torchtitan.distributed.parallel_dims": ("device_type",),
    "torchtitan.distributed.utils": ("device_type", "device_module"),
}
_original_histc = torch.histc
_original_generate_permute_indices = moe_utils.generate_permute_indices


@functools.wraps(_original_histc)
def _histc(input: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    if input.device.type == "cpu" and not input.is_floating_point():
        return _original_histc(input.float(), *args, **kwargs).to(input.dtype)
    return _original_histc(input, *args, **kwargs)


@functools.wraps(_original_generate_permute_indices)
def _generate_permute_indices(tokens_per_expert_group, *args, **kwargs):
    if tokens_per_expert_group.device.type == "cpu":
        kwargs["use_cpu"] = True
    return _original_generate_permute_indices(tokens_per_expert_group, *args, **kwargs)


def select_cpu_device() -> None:
    """Make torchtitan use the CPU (``torch.cpu``) as its device."""
    values = {"device_type": "cpu", "device_module": torch.cpu}
    for module_name, names in _DEVICE_GLOBALS.items():
        module = importlib.import_module(module_name)
        for name in names:
            setattr(module, name, values[name])
    logger.info("running on CPU: torchtitan's device is set to cpu (no CUDA device found)")


def enable_moe_ops() -> None:
    """Make torchtitan's MoE routing and token padding run on CPU tensors (idempotent)."""
    if torch.histc is _histc:
        return
    torch.histc = _histc
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
