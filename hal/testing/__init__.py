"""hal.testing: the conformance suite every hal backend can run.

Against any installed backend, with one command::

    python -m pytest --pyargs hal.testing --hal-backend NAME [--hal-option KEY=VALUE ...]

``--hal-option`` values go to ``hal.get_backend(NAME, **options)`` (ints and
true/false are parsed); keys that name a :class:`Requirements` field
(``host_accessible``) configure the suite instead. Without ``--hal-backend``
the suite uses ``$HAL_BACKEND``, or skips with a reason.

The suite has a vmm half (every backend) and a graph half (streams, pools,
capture, replay, routing) whose tests skip, naming the capability, on a
backend that does not declare it in ``capabilities()``.

A plugin declares what it cannot do on its class::

    class MyBackend:
        hal_requirements = {"host_accessible": False}   # mapped memory is device-only

From a plugin's own tests, one file runs the whole contract::

    from hal.testing.suite import *  # noqa: F401,F403

    @pytest.fixture(scope="session")
    def hal_backend_name() -> str:
        return "mybackend"

:func:`hal.testing.runner.run_suite` runs the suite in a child process and
returns its counts.
"""

import pytest

pytest.register_assert_rewrite("hal.testing.suite", "hal.testing.graph_suite", "hal.testing.machine")

from hal.testing.requirements import Requirements  # noqa: E402
from hal.testing.runner import SuiteResult, run_suite  # noqa: E402

__all__ = ["Requirements", "SuiteResult", "run_suite"]
