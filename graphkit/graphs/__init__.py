"""Graphs over the shared memory: pools by key, capture routing, the isolation check, capture hygiene, and the
runner that captures a step for many batch sizes."""
