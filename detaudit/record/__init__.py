"""Recording: fingerprints, the module-level recorder, the op-level dispatch mode, and the
environment a run records (imports torch)."""
