"""The multi-process suites that ``harness/dist_worker.py`` runs, one module per suite."""
