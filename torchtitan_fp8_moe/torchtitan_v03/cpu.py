"""CPU training with torchtitan 0.3, which assumes an accelerator: the adjustments of
``torchtitan_fp8_moe/cpu.py`` (0.2.2's) that 0.3 needs, pointed at 0.3's modules. Only for
machines without CUDA."""

import torch
from torch.nn.attention.flex_attention import AuxOutput, create_mask
from torchtitan.tools.logging import logger

from .. import cpu

# torchtitan 0.3 modules that bind the device type / module at import time.
_DEVICE_GLOBALS = {
    "torchtitan.tools.utils": ("device_type", "device_module"),
    "torchtitan.tools.profiler": ("device_module",),
    "torchtitan.components.metrics": ("device_type", "device_module"),
    "torchtitan.distributed.parallel_dims": ("device_type",),
    "torchtitan.distributed.utils": ("device_type", "device_module"),
    "torchtitan.models.common.token_dispatcher": ("device_type", "device_module"),
}
_original_disable_division = None


def _disable_fsdp_gradient_division_with_sums(model: torch.nn.Module) -> None:
    _original_disable_division(model)
    cpu.use_sum_reductions(model)


def _flex_attention_math(
    q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options
):
    """FlexAttention as plain fp32 math on the mask's dense form: torch has no FlexAttention
    backward on CPU ("FlexAttention does not support backward on CPU"), compiled or not. For
    the mask-only attention of 0.3's language models (document-causal masks, no score_mod)."""
    if score_mod is not None:
        raise NotImplementedError(
            "float8_moe CPU mode: FlexAttention with a score_mod has no CPU backward in torch, "
            "and the CPU mode's replacement handles masks only; train this model on a GPU"
        )
    if enable_gqa and k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    batch, _, q_len, head_dim = q.shape
    mask = create_mask(block_mask.mask_mod, batch, 1, q_len, k.shape[2], device=q.device)
    scores = q.float() @ k.float().transpose(-2, -1) * (scale or head_dim**-0.5)
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = (torch.exp(scores - lse.unsqueeze(-1)) @ v.float()).to(q.dtype)
    return out, AuxOutput(lse=lse if return_aux.lse else None)


def enable_cpu_training() -> None:
    """What torchtitan 0.3's trainer needs to train its MoE models on CPU with gloo. Call it
    after importing torchtitan and before building the Trainer; only on machines without CUDA."""
    global _original_disable_division
    if torch.cuda.is_available():
        raise RuntimeError("float8_moe: CPU training mode on a machine with CUDA")
    from torchtitan.components import metrics
    from torchtitan.distributed import fsdp
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.common.attention import FlexAttention

    cpu.select_cpu_device(_DEVICE_GLOBALS)
    cpu.use_fp32_gemms_for_bf16()
    metrics.build_device_memory_monitor = cpu.CpuMemoryMonitor
    dist_utils.set_pg_timeouts = cpu._set_pg_timeouts
    torch.distributed.destroy_process_group = cpu._exit_after_training
    FlexAttention._compiled_flex_attn = _flex_attention_math
    if _original_disable_division is None:
        _original_disable_division = fsdp.disable_fsdp_gradient_division
        fsdp.disable_fsdp_gradient_division = _disable_fsdp_gradient_division_with_sums
    logger.info(
        "running on CPU: gloo backend, emulated fp8, FlexAttention as fp32 math; memory is "
        "the process's peak RSS; FSDP reduces gradients with sums (gloo has no PREMUL_SUM); "
        "process-group timeouts are set "
        "without a CUDA barrier; after training the ranks meet at a barrier and exit without "
        "gloo teardown; bf16 GEMMs run as fp32 GEMMs rounded to bf16"
    )
