"""The converted weight tensors, by job:
- ``config.py``: ``WeightConfig``, the settings every converted weight carries;
- ``ops.py``: what an op does to a converted weight, from its schema;
- ``base.py``: what both tensors share (fp8 path, the matmul override hook);
- ``matmuls.py``: the matmul call forms and the fp8 matmuls they run;
- ``tensor.py``: ``Float8MoEWeight``, high-precision storage, FSDP2 hooks;
- ``gathered.py``: ``Float8GatheredWeight``, the fp8 payloads of an fp8 all-gather.
"""

from .base import Fp8Weight, fp8_kernels_available
from .config import WeightConfig
from .gathered import Float8GatheredWeight
from .tensor import Float8MoEWeight

__all__ = [
    "Float8GatheredWeight",
    "Float8MoEWeight",
    "Fp8Weight",
    "WeightConfig",
    "fp8_kernels_available",
]
