"""Which torchtitan is installed: the package's glue for it is picked from this (``__init__``)."""

from importlib.metadata import PackageNotFoundError, version


def _major_minor(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


try:
    TORCHTITAN_VERSION = version("torchtitan")
except PackageNotFoundError:
    raise ImportError(
        "float8_moe: torchtitan is not installed; install the package with the extra of the "
        'torchtitan you use: pip install "torchtitan-fp8-moe[torchtitan-0.2]" (torchtitan 0.2.2) '
        'or "torchtitan-fp8-moe[torchtitan-0.3]" (torchtitan 0.3.0), with pip 23.3 or newer '
        "(an older pip skips these extras: it warns that the package does not provide them)"
    ) from None
# torchtitan 0.3 builds models from Python config registries with converters on the model
# config; 0.2.2 from TOML with a converter registry (torchtitan_v03/ holds 0.3's glue).
TORCHTITAN_V03 = _major_minor(TORCHTITAN_VERSION) >= (0, 3)
