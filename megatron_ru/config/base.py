"""Dataclass → argparse with Megatron's flag names, and one-shot validation.

A config is a plain dataclass whose fields are declared with :func:`arg`::

    @dataclass
    class ParallelConfig:
        tensor_model_parallel_size: int = arg(1, "Tensor-parallel degree (TP).")
        sequence_parallel: bool = arg(False, "Split LayerNorm/dropout along the sequence.")

The flag is the field name with dashes (``--tensor-model-parallel-size``); ``flags=`` adds
aliases or replaces it (``flags=("--checkpoint-activations",)``). A ``bool`` field with a
False default is a switch; one defaulting to True needs an explicit negative flag and
``action="store_false"``. ``Optional[list[...]]``/``list`` fields take ``nargs='+'`` (or ``nargs=`` given to ``arg``).

Validation: a config may define ``problems(self) -> list[str]``; cross-config rules are plain
functions ``rule(configs: dict) -> list[str]`` passed to :func:`validate_all`, which raises a
single ValueError that lists every problem (each naming the flag to change).
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import typing
from typing import Any, Callable, Iterable, Sequence, TypeVar

T = TypeVar("T")

_MISSING = dataclasses.MISSING


def arg(
    default: Any = _MISSING,
    help: str = "",
    *,
    flags: Sequence[str] | None = None,
    choices: Sequence[Any] | None = None,
    action: str | None = None,
    default_factory: Callable[[], Any] | None = None,
    metavar: str | None = None,
    nargs: int | str | None = None,
) -> Any:
    """Declare a config field: its default, its help text (the field's docstring) and flags."""
    meta = {"help": help, "flags": tuple(flags) if flags else None, "choices": choices,
            "action": action, "metavar": metavar, "nargs": nargs}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin is typing.Union or (hasattr(__import__("types"), "UnionType") and origin is __import__("types").UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _add_field(group: argparse._ArgumentGroup, f: dataclasses.Field, tp: Any) -> None:
    meta = f.metadata
    flags = meta.get("flags") or (flag_name(f.name),)
    kwargs: dict[str, Any] = {"dest": f.name, "help": meta.get("help", "")}
    if f.default is not _MISSING:
        kwargs["default"] = f.default
    elif f.default_factory is not _MISSING:  # type: ignore[misc]
        kwargs["default"] = f.default_factory()  # type: ignore[misc]
    else:
        kwargs["required"] = True
    base, _ = _unwrap_optional(tp)
    action = meta.get("action")
    if base is bool:
        kwargs["action"] = action or "store_true"
    else:
        if action:
            kwargs["action"] = action
        origin = typing.get_origin(base)
        if origin in (list, tuple, Sequence, typing.Sequence):
            (elem,) = typing.get_args(base)[:1] or (str,)
            kwargs["nargs"] = meta.get("nargs") or "+"
            kwargs["type"] = elem if elem in (int, float, str) else str
        elif typing.get_origin(base) is typing.Literal:
            kwargs["choices"] = list(typing.get_args(base))
            kwargs["type"] = type(kwargs["choices"][0])
        elif base in (int, float, str):
            kwargs["type"] = base
        if meta.get("choices") is not None:
            kwargs["choices"] = list(meta["choices"])
        if meta.get("metavar"):
            kwargs["metavar"] = meta["metavar"]
    group.add_argument(*flags, **kwargs)


def add_config_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one argument group for dataclass ``cls`` (titled by its first docstring line)."""
    title = (cls.__doc__ or cls.__name__).strip().splitlines()[0]
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("cli", True) is False:
            continue
        _add_field(group, f, hints[f.name])


# argparse takes '-1' and '-.5' as values but '-1e-3' as an unknown option ("expected one
# argument"); with this matcher every number, exponent included, is a value, so a negative
# --lr reaches validation and gets its real message. None of our flags looks like a number.
_NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|infinity|nan)$", re.IGNORECASE)


def accept_negative_numbers(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Let ``parser`` read negative numbers in any float syntax as option values."""
    parser._negative_number_matcher = _NEGATIVE_NUMBER  # type: ignore[attr-defined]
    return parser


def build_parser(classes: Iterable[type], description: str = "", **kwargs: Any) -> argparse.ArgumentParser:
    from megatron_ru.utils.cli import ArgumentParser
    parser = accept_negative_numbers(ArgumentParser(
        description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter, **kwargs))
    for cls in classes:
        add_config_arguments(parser, cls)
    return parser


def from_namespace(cls: type[T], ns: argparse.Namespace) -> T:
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)}
    return cls(**values)


def parse_configs(classes: Sequence[type], argv: Sequence[str] | None = None,
                  description: str = "", allow_unknown: bool = False,
                  extra: Callable[[argparse.ArgumentParser], None] | None = None) -> dict[Any, Any]:
    """Parse ``argv`` into one instance per class (keyed by class). Unknown flags are an error
    unless ``allow_unknown`` (then they are returned under the key ``"unknown"``). ``extra(parser)`` adds flags
    outside the classes; their values are returned under the key ``"namespace"`` (the whole namespace)."""
    parser = build_parser(classes, description)
    if extra is not None:
        extra(parser)
    argv = list(sys.argv[1:] if argv is None else argv)
    if allow_unknown:
        ns, unknown = parser.parse_known_args(argv)
    else:
        ns, unknown = parser.parse_args(argv), []
    out: dict[Any, Any] = {cls: from_namespace(cls, ns) for cls in classes}
    out["namespace"] = vars(ns)
    if allow_unknown:
        out["unknown"] = unknown
    return out


def explicit_dests(classes: Sequence[type], argv: Sequence[str]) -> set[str]:
    """The fields whose flags appear in ``argv`` (given explicitly, even when equal to the default)."""
    parser = build_parser(classes)
    for action in parser._actions:
        action.default = argparse.SUPPRESS
        action.required = False
    ns, _ = parser.parse_known_args(list(argv))
    return set(vars(ns))


def validate_all(configs: Iterable[Any], rules: Iterable[Callable[..., list[str]]] = (),
                 context: Any = None) -> None:
    """Collect every problem from each config's ``problems()`` and each cross rule; raise once."""
    configs = list(configs)
    found: list[str] = []
    for cfg in configs:
        method = getattr(cfg, "problems", None)
        if method is not None:
            found.extend(method())
    for rule in rules:
        found.extend(rule(configs if context is None else context))
    if found:
        lines = "\n".join(f"  - {p}" for p in found)
        raise ValueError(f"invalid configuration ({len(found)} problem{'s' if len(found) > 1 else ''}):\n{lines}")
