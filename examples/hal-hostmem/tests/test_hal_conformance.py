"""The whole hal conformance suite against this backend, as one file of the plugin's own tests."""

import pytest

from hal.testing.suite import *  # noqa: F403


@pytest.fixture(scope="session")
def hal_backend_name() -> str:
    return "hostmem"
