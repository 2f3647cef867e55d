"""Which torchtitan is installed: the package's glue for it is picked from this (``__init__``)."""

from importlib.metadata import version


def _major_minor(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


TORCHTITAN_VERSION = version("torchtitan")
# torchtitan 0.3 builds models from Python config registries with converters on the model
# config; 0.2.2 from TOML with a converter registry (torchtitan_v03/ holds 0.3's glue).
TORCHTITAN_V03 = _major_minor(TORCHTITAN_VERSION) >= (0, 3)
