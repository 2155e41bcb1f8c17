"""Output channel of the package's command-line entry points (``python -m megatron_ru...``).

A CLI's result (a JSON line per rank, a layout table) is its product and goes to stdout
unadorned so scripts can parse it; a user mistake goes to stderr as one ``error:`` line.
Diagnostics and progress go through ``megatron_ru.utils.logging`` instead.
"""
from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import os
import signal
import sys
from typing import Any, Callable, Iterator, NoReturn, Optional, TypeVar

P = TypeVar("P", bound=argparse.ArgumentParser)
_UNRECOGNIZED = "unrecognized arguments: "


def emit(text: str) -> None:
    """Write a result line to stdout in one system call.

    Several ranks share one stdout under mpirun/srun; ``print`` writes the text and the newline
    separately, so two ranks' lines can fuse into one. A single ``write`` of a line shorter than
    the pipe buffer (4 KiB) reaches the reader whole.
    """
    data = (text + "\n").encode("utf-8")
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):  # captured stdout (tests)
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
        return
    sys.stdout.flush()
    while data:
        data = data[os.write(fd, data):]


def error(message: str) -> None:
    """Write a one-line user error to stderr (the caller returns exit code 2)."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()


def unknown_flag_message(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    """``unknown flag --x; did you mean --y?`` for the first flag of ``unknown`` (argparse's leftovers),
    the suggestion drawn by difflib from ``parser``'s own flags; a stray value is named as such."""
    matcher = getattr(parser, "_negative_number_matcher", None)
    flags = [a for a in unknown if a.startswith("-") and not (matcher and matcher.match(a))]
    if not flags:
        return f"unexpected argument {' '.join(unknown)!r} (each value follows its flag; {parser.prog} --help)"
    known = {o[2:]: o for o in parser._option_string_actions if o.startswith("--") and o != "--help"}
    named = list(dict.fromkeys(f.split("=", 1)[0] for f in flags))
    close = {f: [known[m] for m in difflib.get_close_matches(f.lstrip("-"), list(known), n=1, cutoff=0.6)]
             for f in named}
    if len(named) == 1:
        flag = named[0]
        if close[flag]:
            return f"unknown flag {flag}; did you mean {close[flag][0]}?"
        return f"unknown flag {flag}; {parser.prog} --help lists the flags"
    listed = ", ".join(f"{f} (did you mean {close[f][0]}?)" if close[f] else f for f in named)
    return f"unknown flags {listed}; {parser.prog} --help lists the flags"


def one_line_error(parser: argparse.ArgumentParser, message: str) -> str:
    """argparse's ``message`` about ``parser``'s command line as one line, naming where to look."""
    if message.startswith(_UNRECOGNIZED):
        return unknown_flag_message(parser, message[len(_UNRECOGNIZED):].split(" "))
    return f"{parser.prog}: {message} (see {parser.prog} --help)"


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one ``error:`` line on stderr (exit status 2) instead of the
    whole usage followed by the error: a typo in a 90-flag command gets a suggestion, not a page.
    Subcommands (``add_subparsers``) are of this class too, and ``--help`` is unchanged."""

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        # a misspelt flag first: argparse would complain of the required flag it stands for instead
        argv = list(sys.argv[1:] if args is None else args)
        unknown = self._unknown_long_flags(argv)
        if unknown:
            self.error(_UNRECOGNIZED + " ".join(unknown))
        return super().parse_args(argv, namespace)

    def _unknown_long_flags(self, argv: list[str]) -> list[str]:
        """The ``--flags`` in ``argv`` that name none of ours (a unique prefix does, as argparse
        allows), up to ``--``; none when a subcommand takes the rest (it checks its own)."""
        if any(isinstance(a, argparse._SubParsersAction) for a in self._actions):
            return []
        known = [o for o in self._option_string_actions if o.startswith("--")]
        out = []
        for arg in argv:
            if arg == "--":
                break
            flag = arg.split("=", 1)[0]
            if not arg.startswith("--") or flag in known:
                continue
            if not (self.allow_abbrev and any(o.startswith(flag) for o in known)):
                out.append(arg)
        return out

    def error(self, message: str) -> NoReturn:
        line = one_line_error(self, message)
        from megatron_ru.utils.logging import current_rank
        if current_rank() == 0:  # every rank parses the same flags; rank 0 is the one that reports
            from megatron_ru.utils.elastic import record_error
            record_error(line)
        self.exit(2, f"error: {line}\n")


def one_line_errors(parser: P) -> P:
    """``parser`` (built elsewhere as a plain ``argparse.ArgumentParser``) with one-line errors."""
    if not isinstance(parser, ArgumentParser):
        parser.__class__ = type("OneLine" + type(parser).__name__, (ArgumentParser, type(parser)), {})
    return parser


def with_one_line_errors(build: Callable[[], P]) -> Callable[[], P]:
    """A parser factory whose parsers have one-line errors (see :func:`one_line_errors`)."""
    return lambda: one_line_errors(build())


class Terminated(BaseException):
    """SIGTERM as an exception: the cleanup of a half-written output (``finally``/``except BaseException``
    blocks) runs as it does for Ctrl-C, instead of the process ending where it stands."""


#: the exit status of a process ended by SIGTERM (128 + 15), as a shell reports it
TERMINATED_STATUS = 143


_SIGTERM_RECEIVED = [False]


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`Terminated` in the main thread. Library code between the signal
    and the block's end may turn that exception into one of its own (torch's serialization reported a
    ``Terminated`` raised inside it as "could not determine the shape of object type ..."): any exception
    leaving the block after a SIGTERM leaves it as :class:`Terminated` (the original as its cause)."""
    def handler(signum: int, frame: Any) -> None:
        _SIGTERM_RECEIVED[0] = True
        raise Terminated()
    _SIGTERM_RECEIVED[0] = False
    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    except Exception as e:
        if _SIGTERM_RECEIVED[0]:
            raise Terminated() from e
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


def report_tool(prog: str, module: Any, argv: Optional[list[str]] = None) -> int:
    """``main`` of a tool built from ``module`` (``HELP``, ``add_arguments(parser)``, ``run(args) -> dict``):
    the report as one JSON line on stdout, exit 0; a user mistake as one ``error:`` line, exit 2."""
    import json
    parser = ArgumentParser(prog=prog, description=module.HELP, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    module.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        with sigterm_raises():
            report = module.run(args)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        error(str(e))
        return 2
    except Terminated:
        error("terminated (SIGTERM); nothing was written under the output name")
        return TERMINATED_STATUS
    emit(json.dumps(report, default=str, ensure_ascii=False))
    return 0
