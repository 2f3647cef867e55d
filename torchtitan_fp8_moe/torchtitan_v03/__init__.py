"""torchtitan 0.3 glue: the `float8_moe` converter as a model-config converter
(``converter.py``, run settings in ``run.py``), config-registry entries
(``config_registry.py``), CPU training (``cpu.py``, ``train.py``) and preflight
(``preflight.py``). The conversion itself is the package's, shared with torchtitan 0.2.2."""

from .converter import Float8MoEConverter

__all__ = ["Float8MoEConverter"]
