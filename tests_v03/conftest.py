"""The torchtitan 0.3 suite: runs only where torchtitan 0.3 is installed (.ci/run makes a
virtual environment for it); elsewhere every test here is skipped."""

import pytest

from torchtitan_fp8_moe.torchtitan_version import TORCHTITAN_V03, TORCHTITAN_VERSION


def pytest_collection_modifyitems(config, items):
    if TORCHTITAN_V03:
        return
    skip = pytest.mark.skip(reason=f"torchtitan 0.3 suite; torchtitan {TORCHTITAN_VERSION} here")
    for item in items:
        item.add_marker(skip)


def pytest_ignore_collect(collection_path, config):
    # The modules import torchtitan 0.3's API at import time.
    return (
        not TORCHTITAN_V03
        and collection_path.suffix == ".py"
        and collection_path.name != "conftest.py"
    )
