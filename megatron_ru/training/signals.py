"""Exit on a signal: SIGTERM/SIGUSR1 (sent by Slurm/ABCI before the time limit) → save and exit 0.

The handler only records the signal; the training loop polls :meth:`ExitSignal.received`
after each iteration, and every rank agrees (all-reduce MAX) so that all ranks stop at the same
iteration and the checkpoint they write together is complete.
"""
from __future__ import annotations

import signal
from typing import Any, Optional

import torch
import torch.distributed as dist

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class ExitSignal:
    def __init__(self, signals: tuple[int, ...] = DEFAULT_SIGNALS) -> None:
        self.signals = signals
        self.signum: Optional[int] = None
        self._previous: dict[int, Any] = {}

    def install(self) -> "ExitSignal":
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, _frame: Any) -> None:
        self.signum = signum

    def restore(self) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)
        self._previous.clear()

    def received(self, device: torch.device = torch.device("cpu"), group: Any = None) -> bool:
        """True on every rank if any rank got a signal (collective when distributed; ``device``
        is the one the backend communicates on)."""
        flag = torch.tensor([1 if self.signum is not None else 0], dtype=torch.int32, device=device)
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())
