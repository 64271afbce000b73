"""The fake backend's block pool: the public host recorder's (:mod:`hal.host.pool`) under its former name."""

from hal.host.pool import BLOCK_ROUND, BlockPool

__all__ = ["BLOCK_ROUND", "BlockPool"]
