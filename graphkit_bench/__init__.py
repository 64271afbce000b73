"""The bench and demo of graphkit: every memory strategy side by side.

Not part of the library: it ships beside it in the same distribution, and the ``bench`` extra brings what it
needs besides (``pip install "hal-graphkit[bench]"``). ``python -m graphkit demo`` and ``python -m graphkit bench``
run its command line (:mod:`graphkit_bench.cli`), as does ``python -m graphkit_bench``; the single benches run as
``python -m graphkit_bench.overhead``, ``.fakereplay``, ``.mapcalls``.
"""
