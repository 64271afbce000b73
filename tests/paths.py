"""Where the tests find the repository, its examples and the scripts the device tests run in child processes."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
SCRIPTS = TESTS / "cuda_scripts"
