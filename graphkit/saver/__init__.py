"""Sleep and wake by tag: a :class:`MemorySaver` releases and restores what each tag holds (graph memory,
KV caches, buffers), with or without a host backup."""

from graphkit.saver.memory_saver import GRAPHS, MemorySaver, SaverReport, Sleeper, TagReport, saver_holding

__all__ = ["GRAPHS", "MemorySaver", "SaverReport", "Sleeper", "TagReport", "saver_holding"]
