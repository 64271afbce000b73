"""One version source: hal.__version__; graphkit and the package metadata agree with it."""

from __future__ import annotations

import importlib.metadata

import graphkit
import hal


def test_one_version_everywhere() -> None:
    assert graphkit.__version__ == hal.__version__
    assert importlib.metadata.version("hal-graphkit") == hal.__version__
