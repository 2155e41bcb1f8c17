"""Real one-node Slurm and Grid Engine clusters for the job-script tests.

The fixtures install the Debian packages when they are missing, configure the daemons for
loopback, start them by PID and stop them at the end (see /work/shared/SCHEDULERS.md for the
facts this relies on). Tests then submit the project's own scripts in ``scripts/`` with
``sbatch``/``qsub`` and only environment overrides.
"""
