#!/usr/bin/env python
"""Pretrain a GPT/LLaMA model with megatron_ru (Megatron-LM's flag names, DeepSpeed engine).

    python pretrain_gpt.py ARGS                       # one process
    torchrun --nproc-per-node 4 pretrain_gpt.py ARGS  # or: mpirun -np 4 / srun / deepspeed
    python pretrain_gpt.py --help                     # every flag

See docs/training.md. Exit status: 0 done (also after --exit-signal-handler saved), 2 invalid
configuration or input (flags, data, checkpoint files), 1 a failure during training. An error is
printed once per job, without a traceback unless MEGATRON_RU_DEBUG=1.
"""
import sys
import time

JOB_STARTED = time.time()  # --exit-duration-in-mins counts from here, imports included

# before the slow imports: a SIGTERM/SIGUSR1 that arrives during start-up is kept, not fatal
from megatron_ru.training.signals import install_if_requested  # noqa: E402

EXIT_SIGNAL = install_if_requested(sys.argv[1:])

# a rank whose launcher (mpirun, torchrun, srun) is killed ends within seconds, start-up included
from megatron_ru.parallel.launcher_watch import watch_launcher  # noqa: E402

LAUNCHER_WATCH = watch_launcher()

from megatron_ru.parallel.failure import exit_with  # noqa: E402
from megatron_ru.training.pretrain import main  # noqa: E402

if __name__ == "__main__":
    # a failure: at once, without waiting on peers; done: without the interpreter's finalisation, where
    # a daemon thread inside a torch call can abort the process (SIGABRT after a finished job)
    exit_with(main(job_started=JOB_STARTED, exit_signal=EXIT_SIGNAL))
