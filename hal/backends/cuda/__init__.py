"""``cuda``: NVIDIA GPUs through cuda-python's driver API and torch.cuda."""

from hal.backends.cuda.probe import CudaBackend

__all__ = ["CudaBackend"]
