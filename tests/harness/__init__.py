"""The multi-process test harness: ``fork_launch.py`` starts the ranks of a launch as forks of a
process that has done the imports, ``dist_worker.py`` runs the suites of ``suites/`` in one
launch, ``parallel_checks.py`` holds the bar of their parallelism cases, ``trainer_batch.py``
runs torchtitan's trainer for several runs in one launch."""
