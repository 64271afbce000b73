"""hal.testing: the conformance suite every hal backend can run."""
