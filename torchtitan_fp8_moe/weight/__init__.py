"""The converted weight tensors, by job:
- ``config.py``: ``WeightConfig``, the settings every converted weight carries;
- ``ops.py``: an op's kind, from its schema, and ``OpTable``: each weight type's handler per kind;
- ``base.py``: what both tensors share (fp8 path, the matmul override hook);
- ``matmuls.py``: the matmul call forms and the fp8 matmuls they run;
- ``tensor.py``: ``Float8MoEWeight``, high-precision storage;
- ``tensor_ops.py``: what each kind of op does to a ``Float8MoEWeight``;
- ``lazy_cast.py``: ``LazyCastWeight``, the forward's bf16 cast of an fp32 parameter, no copy;
- ``fsdp.py``: FSDP2's all-gather hooks, and how FSDP2 shards a weight;
- ``gathered.py``: ``Float8GatheredWeight``, the fp8 payloads of an fp8 all-gather.
"""

from . import tensor_ops  # noqa: F401  (registers Float8MoEWeight's op handlers)
from .base import Fp8Weight, fp8_kernels_available
from .config import WeightConfig
from .gathered import Float8GatheredWeight
from .lazy_cast import LazyCastWeight
from .tensor import Float8MoEWeight

__all__ = [
    "Float8GatheredWeight",
    "Float8MoEWeight",
    "Fp8Weight",
    "LazyCastWeight",
    "WeightConfig",
    "fp8_kernels_available",
]
