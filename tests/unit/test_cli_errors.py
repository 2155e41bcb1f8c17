"""Usage mistakes are one line with a suggestion (utils/cli.ArgumentParser), and a worker's error
reaches torchrun's report through torch's elastic error file (utils/elastic, megatron_ru.launch)."""
import argparse
import importlib.util
import os

import pytest

from megatron_ru.flags.arguments import parse_arguments
from megatron_ru.utils import cli, elastic

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _stderr_of(capsys, fn, *args):
    with pytest.raises(SystemExit) as e:
        fn(*args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line, no usage
    return err.strip()


def test_a_misspelt_flag_is_one_line_with_the_closest_flag(capsys):
    err = _stderr_of(capsys, parse_arguments, ["--tensor-model-paralel-size", "1"])
    assert err == ("error: unknown flag --tensor-model-paralel-size; "
                   "did you mean --tensor-model-parallel-size?")


def test_several_unknown_flags_and_a_stray_value(capsys):
    err = _stderr_of(capsys, parse_arguments, ["--lr", "-1e-3", "--foo=3", "--nm-layers", "2"])
    assert err.startswith("error: unknown flags --foo, --nm-layers (did you mean --num-layers?);")
    err = _stderr_of(capsys, parse_arguments, ["--num-layers", "2", "3"])
    assert err.startswith("error: unexpected argument '3'")


def test_a_typo_of_a_required_flag_is_named_as_a_typo(capsys):
    p = cli.ArgumentParser(prog="tool")
    p.add_argument("--load", required=True)
    assert _stderr_of(capsys, p.parse_args, ["--lod", "x"]) == "error: unknown flag --lod; did you mean --load?"
    assert _stderr_of(capsys, p.parse_args, []) == ("error: tool: the following arguments are required: "
                                                    "--load (see tool --help)")


def test_abbreviations_and_help_are_argparse_s(capsys):
    p = cli.ArgumentParser(prog="tool")
    p.add_argument("--num-gpus", type=int)
    assert p.parse_args(["--num-gpu", "3"]).num_gpus == 3
    assert "unknown flag --hlp;" in _stderr_of(capsys, p.parse_args, ["--hlp"])  # never suggests --help
    with pytest.raises(SystemExit) as e:
        p.parse_args(["--help"])
    assert e.value.code == 0 and "usage: tool" in capsys.readouterr().out


def test_a_plain_parser_built_elsewhere_gets_one_line_errors(capsys):
    p = cli.one_line_errors(argparse.ArgumentParser(prog="other"))
    p.add_argument("--input")
    assert _stderr_of(capsys, p.parse_args, ["--inptu", "x"]) == "error: unknown flag --inptu; did you mean --input?"


def _convert_checkpoint():
    path = os.path.join(ROOT, "tools", "convert_checkpoint.py")
    spec = importlib.util.spec_from_file_location("convert_checkpoint", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_convert_checkpoint_subcommands_report_against_their_own_flags(capsys):
    main = _convert_checkpoint().main
    assert _stderr_of(capsys, main, ["reshard", "--load", "a", "--save", "b", "--target-tensor-paralel-size", "2"]) \
        == "error: unknown flag --target-tensor-paralel-size; did you mean --target-tensor-parallel-size?"
    assert _stderr_of(capsys, main, ["import-hf", "--save", "b"]) == (
        "error: convert_checkpoint.py import-hf: the following arguments are required: --load "
        "(see convert_checkpoint.py import-hf --help)")
    assert "invalid choice: 'imprt-hf'" in _stderr_of(capsys, main, ["imprt-hf"])
    with pytest.raises(SystemExit):
        main(["export-hf", "--help"])
    assert capsys.readouterr().out.startswith("usage: convert_checkpoint.py export-hf")


def test_the_error_file_is_the_one_torch_elastic_reads(tmp_path, monkeypatch):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
    path = tmp_path / "0" / "error.json"
    elastic.record_error("first", env={elastic.ERROR_FILE_VAR: str(path)})
    elastic.record_error("--data-path: dataset 'x' not found", env={elastic.ERROR_FILE_VAR: str(path)})
    elastic.record_error("ignored", env={})
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(path))
    report = ChildFailedError("pretrain_gpt.py", {0: failure}).format_msg()
    assert "traceback : --data-path: dataset 'x' not found" in report
    assert elastic.recorded_message(str(path)) == "--data-path: dataset 'x' not found"
    assert elastic.recorded_message(str(tmp_path / "none.json")) is None


def test_the_launcher_ends_on_the_worker_message_and_status(tmp_path):
    from megatron_ru.launch import failure_line
    path = tmp_path / "error.json"
    elastic.record_error("unknown flag --x", env={elastic.ERROR_FILE_VAR: str(path)})
    assert failure_line(0, 2, str(path)) == ("unknown flag --x", 2)
    assert failure_line(3, 1, "<N/A>") == ("rank 3 exited with status 1 (its log above says why)", 1)
    assert failure_line(1, -9, "<N/A>") == ("rank 1 was killed by SIGKILL", 137)


def test_a_sigterm_that_a_library_turned_into_its_own_error_still_ends_as_terminated():
    """torch's serialization once reported the Terminated a SIGTERM raised inside it as "could not determine the
    shape of object type 'torch.storage.UntypedStorage'", and the converter exited 2 (an input error) instead
    of 143: whatever leaves the block after a SIGTERM leaves it as Terminated; before one, errors pass as they are."""
    import os
    import signal

    import pytest

    from megatron_ru.utils import cli

    def library_call():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            signal.pthread_sigmask(signal.SIG_SETMASK, [])  # the handler runs here, inside the "library"
        except BaseException as e:  # noqa: BLE001 - what a C extension's error translation does
            raise ValueError("could not determine the shape of object type 'torch.storage.UntypedStorage'") from e

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(cli.Terminated) as caught:
        with cli.sigterm_raises():
            library_call()
    assert isinstance(caught.value.__cause__, ValueError)
    with pytest.raises(ValueError, match="not a signal"):
        with cli.sigterm_raises():
            raise ValueError("not a signal")
    assert signal.getsignal(signal.SIGTERM) is before  # the handler of before the block, back
