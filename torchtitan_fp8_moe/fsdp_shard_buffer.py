"""FSDP2 keeps a converted weight's shard in one buffer for the whole run.

FSDP2 copies an unevenly sharded parameter's rows into a buffer of the padded shard size and
makes the local tensor a narrow of it. ``FSDPParam.reset_sharded_param`` checks that again at
lazy init (the first forward), after ``Module._apply`` (``to_empty``) and after every
``load_state_dict``: a plain local tensor that already lives in the buffer is kept, but for a
tensor subclass torch cannot tell (its "TODO: need to support tensor subclass") and copies the
rows into a new buffer. A state dict taken before that, as torchtitan takes its checkpoint state
dict once, then views the old storage, and every save writes the rows' initial values. Even
shards are never re-padded, which is why only uneven ones lost training.

``install()`` teaches ``reset_sharded_param`` the subclass case: a converted weight whose data
already lives in the buffer stays where it is, as a plain tensor would. That holds with CPU offload
too (torchtitan's ``enable_cpu_offload``): FSDP2 pinned the buffer when it made it, so a shard in
it is pinned already, and torch keeps a plain tensor there as well.
"""

import functools

from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

from .weight import Float8MoEWeight


def _shard_in_buffer(fsdp_param: FSDPParam) -> bool:
    """Whether the parameter is a converted weight whose data is a view of FSDP's padded
    shard buffer: torch's own test for plain tensors, on the wrapped data."""
    info = fsdp_param._module_info
    param = getattr(info.module, info.param_name)
    if param is not fsdp_param.sharded_param:
        return False  # a new parameter (load with assign=True): torch's path
    local, buffer = param._local_tensor, fsdp_param._sharded_param_data
    if not (isinstance(local, Float8MoEWeight) and isinstance(buffer, Float8MoEWeight)):
        return False
    buffer_storage = buffer._data.untyped_storage().data_ptr()
    return buffer_storage != 0 and local._data.untyped_storage().data_ptr() == buffer_storage


def install() -> None:
    """Patch ``FSDPParam.reset_sharded_param`` once per process (idempotent): torch's own
    re-pads every tensor-subclass shard into a new buffer (its "TODO: need to support tensor
    subclass", torch/distributed/fsdp/_fully_shard/_fsdp_param.py), so an uneven shard of a
    converted weight leaves the state dict taken before viewing its old storage. Called where
    weights are converted (``swap.swap_expert_weights``, under either torchtitan version's
    converter and ``convert``), never at import."""
    reset = FSDPParam.reset_sharded_param
    if getattr(reset, "_keeps_fp8_shard_buffer", False):
        return

    @functools.wraps(reset)
    def reset_sharded_param(fsdp_param: FSDPParam) -> None:
        if not _shard_in_buffer(fsdp_param):
            return reset(fsdp_param)
        # What torch does for a plain tensor already in the buffer: keep it, refresh the spec.
        fsdp_param._sharding_spec = fsdp_param.sharded_param._spec

    reset_sharded_param._keeps_fp8_shard_buffer = True
    FSDPParam.reset_sharded_param = reset_sharded_param
