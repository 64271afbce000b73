"""The C allocator callbacks outlive the interpreter's teardown (framework memory freed at exit calls them)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_callbacks_survive_the_last_collection_at_exit() -> None:
    """A tensor freed in the collection that ends the interpreter calls free(); the process still exits 1."""
    script = textwrap.dedent('''
        import gc
        from hal.backends._native import callbacks

        pair = callbacks.new_pair(lambda n: 4096, lambda p, n: None, device=0, backend="test")
        free_address = pair.addresses[1]
        del pair
        callbacks.KEEP_ALIVE.clear()  # what clearing the module's globals at exit does
        gc.collect()  # the interpreter's last collection, before the framework frees its memory
        for _ in range(3):  # framework memory freed after that calls free()
            callbacks.FREE_FN(free_address)(4096, 4096, 0, None)
        raise SystemExit("failed on purpose")
    ''')
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, (done.returncode, done.stderr[-2000:])
    assert "failed on purpose" in done.stderr
