"""What the converted weight tensors share: every matmul they are the right operand of runs in
fp8 through the overrides of ``matmuls.py``, by the recipe and path of their ``WeightConfig``."""

import hashlib

import torch

from ..fp8.recipes import Recipe
from ..fp8.scaled_grouped_mm import WeightSource
from .config import WeightConfig
from .matmuls import AUTOCAST_LOWER_PRECISION, MATMUL_HANDLERS


def fp8_kernels_available(device: torch.device) -> bool:
    """Whether ``device`` has fp8 tensor cores (CUDA sm89 or newer)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


class Fp8Weight(torch.Tensor):
    config: WeightConfig

    @property
    def emulate(self) -> bool:
        return self.config.emulate

    def fp8_operand(self, transpose: bool = False) -> tuple[torch.Tensor, WeightSource]:
        """(the matmul's right operand ``b``: this weight, or with ``transpose`` its last two
        dims swapped; where its fp8 copies come from: a weight quantizer, the payloads, or
        None to quantize ``b``)."""
        raise NotImplementedError

    def fp8_path(self) -> tuple[Recipe, bool]:
        """(the recipe, whether to emulate): raises where fp8 kernels are asked for but absent."""
        config = self.config
        if not config.emulate and not fp8_kernels_available(self.device):
            raise RuntimeError(
                f"float8_moe: a weight of shape {list(self.shape)} on {self.device} has no fp8 "
                "kernels (they need CUDA sm89+). Set `[float8_moe] emulate = true` to run the "
                "emulated fp8 path, or leave it out of `float8_moe.fqns`."
            )
        return config.fp8_recipe, config.emulate

    def _stable_hash_for_caching(self) -> str:
        """This weight in the key of torch.compile's AOTAutograd cache: torch's extension point
        for tensor subclasses (torch 2.13 and 2.15 call it where a graph's inputs hold one;
        without it torch warns and hashes the flatten metadata without the class). The class,
        the flatten metadata (configuration) and the outer and inner tensors' shapes, strides,
        dtypes and devices: no storage address, the same in every process. A DTensor holding
        this weight hashes only its own spec, and no key holds this package's code: the tag of
        ``compile_cache.py`` covers those."""
        names, metadata = self.__tensor_flatten__()
        payload = (
            type(self).__module__,
            type(self).__qualname__,
            repr(metadata),
            _tensor_key(self),
            self.requires_grad,
            tuple((name, _tensor_key(getattr(self, name))) for name in names),
        )
        return hashlib.blake2b(repr(payload).encode(), digest_size=16).hexdigest()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = MATMUL_HANDLERS.get(getattr(func, "__name__", None))
        if handler is not None and args and isinstance(args[0], Fp8Weight):
            raise NotImplementedError(
                f"float8_moe: {func.__name__} with a Float8MoEWeight as its left operand "
                f"(shape {list(args[0].shape)}) is not supported; the weight must be the right "
                "operand"
            )
        if handler is not None and len(args) > 1 and isinstance(args[1], Fp8Weight):
            a, weight, *rest = args
            if func.__name__ in AUTOCAST_LOWER_PRECISION:
                a, rest, kwargs = _as_autocast(a, rest, kwargs)
            return handler(a, weight, *rest, **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def _tensor_key(t: torch.Tensor | None) -> tuple | None:
    if t is None:
        return None
    return (tuple(t.shape), t.stride(), str(t.dtype), t.device.type)


def _as_autocast(a: torch.Tensor, rest: tuple, kwargs: dict) -> tuple:
    """The operands other than the weight as autocast would hand them to the op: cast to its
    dtype where it is on for ``a``'s device. Overrides run before autocast sees the op, and
    without this an fp32 activation (single-device and DDP runs: torchtitan trains under
    autocast there) came out fp32 where bf16's op gives bf16, doubling the memory of every
    activation after it. The weight is quantized from its own values either way."""
    device_type = a.device.type
    if not (
        a.is_floating_point()
        and torch.amp.is_autocast_available(device_type)  # not on meta
        and torch.is_autocast_enabled(device_type)
    ):
        return a, rest, kwargs
    dtype = torch.get_autocast_dtype(device_type)

    def cast(x):
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    return cast(a), tuple(map(cast, rest)), {k: cast(v) for k, v in kwargs.items()}


class _ShapeOnly(torch.autograd.Function):
    """A plain tensor of a weight's shape and dtype holding no values, for the fp8 GEMM to
    return the weight gradient through where its fp8 copies come from elsewhere."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor) -> torch.Tensor:
        return shape_only(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def shape_only(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor of ``t``'s shape, dtype and device holding no values (one element,
    expanded)."""
    return torch.empty((), dtype=t.dtype, device=t.device).expand(t.shape)


def shape_only_operand(weight: torch.Tensor) -> torch.Tensor:
    """``shape_only(weight)``, differentiable: gradients flow back to ``weight``."""
    return _ShapeOnly.apply(weight)
