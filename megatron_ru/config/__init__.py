"""Configuration: one dataclass per concern, argparse generated from the fields.

See ``base.py`` for the mechanism. Concern-specific dataclasses live next to it
(``data.py``, ``parallel.py``, ``model.py``, ``training.py``).
"""
from megatron_ru.config.base import arg, build_parser, parse_configs, validate_all

__all__ = ["arg", "build_parser", "parse_configs", "validate_all"]
