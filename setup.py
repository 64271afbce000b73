"""What pyproject.toml cannot say: the start-up hook file goes to the root of site-packages.

Python reads the ``.pth`` files of site-packages when any process starts; a
file inside a package is never read. ``build_startup_hook`` (a step of
``build``) puts ``graphkit-startup.pth`` at the root of the wheel for
``pip install .``; for ``pip install -e .`` (a PEP 660 editable wheel) it
writes it where setuptools collects the editable wheel's files that are not
editable (scripts and data go there too), so both installs carry it. pip
removes it with the rest on uninstall.
"""

from __future__ import annotations

import os
from typing import ClassVar

from setuptools import Command, setup
from setuptools.command.build import build

HOOK = "graphkit-startup.pth"


class build_startup_hook(Command):
    """Copy the start-up hook (``graphkit-startup.pth``) to the root of what gets installed."""

    description = "put graphkit's start-up hook (.pth) at the root of site-packages"
    user_options: ClassVar[list[tuple[str, str | None, str]]] = []

    def initialize_options(self) -> None:
        self.build_lib: str | None = None
        self.editable_mode = False

    def finalize_options(self) -> None:
        self.set_undefined_options("build_py", ("build_lib", "build_lib"))

    def _target(self) -> str:
        if self.editable_mode:  # the editable wheel's own folder (setuptools points install_lib at it)
            return str(self.get_finalized_command("install").install_lib)
        return str(self.build_lib)

    def run(self) -> None:
        self.copy_file(HOOK, os.path.join(self._target(), HOOK))

    def get_source_files(self) -> list[str]:
        return [HOOK]

    def get_outputs(self) -> list[str]:
        return [] if self.editable_mode else [os.path.join(str(self.build_lib), HOOK)]

    def get_output_mapping(self) -> dict[str, str]:
        return {}


class build_with_startup_hook(build):
    sub_commands: ClassVar[list[tuple[str, object]]] = [*build.sub_commands, ("build_startup_hook", None)]


setup(cmdclass={"build": build_with_startup_hook, "build_startup_hook": build_startup_hook})
