"""Exit on a signal: SIGTERM/SIGUSR1 (sent by Slurm/ABCI before the time limit) → save and exit 0.

The handler only records the signal; the training loop polls :meth:`ExitSignal.received`
after each iteration, and every rank agrees (all-reduce MAX) so that all ranks stop at the same
iteration and the checkpoint they write together is complete.

``pretrain_gpt.py`` installs the handler first thing, before importing torch, so that a signal
arriving during start-up (imports, rendezvous, data indexing, checkpoint loading: minutes on a
large job) is kept too and acted on after the first iteration. This module therefore imports
nothing heavy at module level.
"""
from __future__ import annotations

import signal
from typing import TYPE_CHECKING, Any, Optional, Sequence

if TYPE_CHECKING:
    import torch

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
#: the flag that asks for the handler (Megatron's name)
FLAG = "--exit-signal-handler"


class ExitSignal:
    def __init__(self, signals: tuple[int, ...] = DEFAULT_SIGNALS) -> None:
        self.signals = signals
        self.signum: Optional[int] = None
        self._previous: dict[int, Any] = {}

    def install(self) -> "ExitSignal":
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def _handle(self, signum: int, _frame: Any) -> None:
        self.signum = signum

    def restore(self) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)
        self._previous.clear()

    def received(self, device: Optional["torch.device"] = None, group: Any = None) -> bool:
        """True on every rank if any rank got a signal (collective when distributed; ``device``
        is the one the backend communicates on, CPU by default)."""
        import torch
        import torch.distributed as dist
        flag = torch.tensor([1 if self.signum is not None else 0], dtype=torch.int32,
                            device=device if device is not None else torch.device("cpu"))
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())


def install_if_requested(argv: Sequence[str]) -> Optional[ExitSignal]:
    """Install the handler now when the command line asks for it (``--exit-signal-handler``),
    before anything slow runs; parsing and validation come later."""
    return ExitSignal().install() if FLAG in argv else None
