"""``python -m megatron_ru.plan``: see :mod:`megatron_ru.plan.cli`."""
import sys

from megatron_ru.plan.cli import run

sys.exit(run())
