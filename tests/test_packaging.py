"""What the installed package says about itself, and the suite's warnings filter
(pyproject.toml: a warning raised from the package's own modules fails the test)."""

from importlib.metadata import version

import pytest

import torchtitan_fp8_moe

PROBE = compile("import warnings\nwarnings.warn('probe', UserWarning)", "<probe>", "exec")


def test_version_is_the_installed_distributions():
    assert torchtitan_fp8_moe.__version__ == version("torchtitan-fp8-moe")


def test_a_warning_from_the_package_fails_the_test():
    """warnings attributes a warning to the module of the frame that raised it (stacklevel 1:
    the caller of ``warnings.warn``), here any module of the package; others' stay warnings."""
    with pytest.raises(UserWarning, match="probe"):
        exec(PROBE, {"__name__": "torchtitan_fp8_moe.cpu"})
    with pytest.warns(UserWarning, match="probe"):
        exec(PROBE, {"__name__": "torchtitan.components.metrics"})
