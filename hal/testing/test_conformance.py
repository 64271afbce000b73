"""Collected by ``python -m pytest --pyargs hal.testing --hal-backend NAME``."""

from hal.testing.suite import *  # noqa: F403
