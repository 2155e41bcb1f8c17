#!/usr/bin/env python
"""Convert megatron_ru checkpoints (Megatron-style flags).

    python tools/convert_checkpoint.py import-hf --load HF_DIR --save DIR \\
        --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2 [--dtype bf16]
    python tools/convert_checkpoint.py export-hf --load DIR --save HF_OUT [--max-shard-size 5GB]
    python tools/convert_checkpoint.py reshard --load DIR --save DIR2 \\
        --target-tensor-parallel-size T --target-pipeline-parallel-size P

Each subcommand is a module with ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> dict`` (its report, printed as one JSON line on stdout); a new subcommand is one
more line in ``SUBCOMMANDS``. Outputs are written under a temporary name and renamed when
complete; an existing output is replaced only with ``--force``. A user mistake prints one
``error:`` line and exits with status 2.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ru.checkpointing.files import CheckpointSaveError  # noqa: E402
from megatron_ru.utils import cli  # noqa: E402

#: subcommand -> module providing HELP, add_arguments(parser) and run(args)
SUBCOMMANDS = {
    "import-hf": "megatron_ru.convert.import_hf",
    "export-hf": "megatron_ru.convert.export_hf",
    "reshard": "megatron_ru.checkpointing.reshard",
}


def _module(name: str):
    try:
        return importlib.import_module(SUBCOMMANDS[name])
    except ModuleNotFoundError as e:
        if e.name and SUBCOMMANDS[name].startswith(e.name):  # that subcommand is not part of this version
            return None
        raise


def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    parser = cli.ArgumentParser(prog="convert_checkpoint.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(SUBCOMMANDS) + "}")
    modules = {}
    for name in SUBCOMMANDS:
        mod = _module(name)
        if mod is None:
            continue
        modules[name] = mod
        p = sub.add_parser(name, help=mod.HELP, description=mod.HELP,
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        mod.add_arguments(p)
    return parser, modules


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``argv`` parsed by the subcommand's own parser when it names one, so that its mistakes are
    reported against its flags (argparse would pass a subcommand's unknown flag up to the top level)."""
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    if argv and argv[0] in subparsers:
        args = subparsers[argv[0]].parse_args(argv[1:])
        args.command = argv[0]
        return args
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    parser, modules = build_parser()
    args = parse(parser, list(sys.argv[1:] if argv is None else argv))
    try:
        with cli.sigterm_raises():  # a SIGTERM cleans up like Ctrl-C: the temporary output is removed
            report = modules[args.command].run(args)
    except cli.Terminated:
        cli.error("terminated (SIGTERM); nothing was written under the output name")
        return cli.TERMINATED_STATUS
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        cli.error(str(e))
        return 2
    except CheckpointSaveError as e:  # the output could not be written (a full disk); nothing was left
        cli.error(str(e))
        return 1
    except OSError as e:  # e.g. a full disk while writing: the output's temporary directory is already removed
        cli.error(f"{e}; nothing was written under the output name")
        return 1
    except KeyboardInterrupt:
        cli.error("interrupted; nothing was written under the output name")
        return 130
    if report:
        cli.emit(json.dumps(report, default=str))
        hint = report.get("continue_with") if isinstance(report, dict) else None
        if hint:  # the command last, on a line of its own, to paste
            sys.stderr.write(f"continue with ({hint['note']}):\n{hint['command']}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
