"""The bench and demo: every memory strategy side by side."""
