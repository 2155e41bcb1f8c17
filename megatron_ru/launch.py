"""torchrun that ends on the worker's own error: ``python -m megatron_ru.launch [torchrun flags] SCRIPT [ARGS]``.

    python -m megatron_ru.launch --nproc-per-node 4 pretrain_gpt.py --tensor-model-parallel-size 2 ...

It takes torchrun's flags and runs torchrun's own code (``torch.distributed.run``), in this process.
What differs is the end of a failed job. Bare torchrun raises ``ChildFailedError``: ~35 lines of its
own traceback and a summary table after the worker's message, and exit status 1 whatever the
worker returned. Here the last line is the failing worker's message, ``error: ...`` (from torch's
elastic error file, which our entry points write: :mod:`megatron_ru.utils.elastic`), and the exit
status is that worker's: 2 for a configuration or input error, 1 for a failure during training,
128 + N for a worker killed by signal N. A job that succeeds ends as under torchrun (status 0).
"""
from __future__ import annotations

import signal
import sys
from typing import Optional, Sequence

from megatron_ru.utils.elastic import recorded_message


def failure_line(rank: int, exitcode: int, error_file: Optional[str]) -> tuple[str, int]:
    """The line that ends a failed job, and the exit status, from the root-cause worker's failure."""
    message = recorded_message(error_file)
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return message or f"rank {rank} was killed by {name}", 128 - exitcode
    return message or f"rank {rank} exited with status {exitcode} (its log above says why)", exitcode


def main(argv: Optional[Sequence[str]] = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        run(args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        line, code = failure_line(rank, failure.exitcode, failure.error_file)
        sys.stdout.flush()
        sys.stderr.write(f"error: {line}\n")
        sys.stderr.flush()
        return code if code > 0 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
