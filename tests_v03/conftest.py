"""The torchtitan 0.3 suite: collected only where torchtitan 0.3 is installed (.ci/run makes a
virtual environment for it); with torchtitan 0.2.2 it collects nothing."""

from torchtitan_fp8_moe.torchtitan_version import TORCHTITAN_V03


def pytest_ignore_collect(collection_path, config):
    # The test modules import torchtitan 0.3's API at import time; None: pytest's own rules.
    if not TORCHTITAN_V03 and collection_path.suffix == ".py":
        return collection_path.name != "conftest.py"
    return None
