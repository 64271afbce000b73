"""hal-hostmem: a hal backend over host memory, and the template for writing one."""

from hal_hostmem.backend import HostMemBackend

__all__ = ["HostMemBackend"]
