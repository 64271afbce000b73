"""``cuda``: NVIDIA GPUs through cuda-python's driver API and torch.cuda.

Importing this package imports neither cuda-python nor torch: the probe
stays cheap on machines without them.
"""

from hal.backends.cuda.backend import CudaBackend

__all__ = ["CudaBackend"]
