#!/usr/bin/env python
"""Pretrain a GPT/LLaMA model with megatron_ru (Megatron-LM's flag names, DeepSpeed engine).

    python pretrain_gpt.py ARGS                       # one process
    torchrun --nproc-per-node 4 pretrain_gpt.py ARGS  # or: mpirun -np 4 / srun / deepspeed
    python pretrain_gpt.py --help                     # every flag

See docs/training.md. Exit status: 0 done (also after --exit-signal-handler saved), 2 invalid
configuration, 1 a failure during training.
"""
import sys
import time

JOB_STARTED = time.time()  # --exit-duration-in-mins counts from here, imports included

from megatron_ru.training.pretrain import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(job_started=JOB_STARTED))
