"""Item 6 of issue 33: the demos echo commands that paste into a shell, and a generation that ends in
line breaks does not print a tail of blank lines."""
import os
import shlex
import sys

from megatron_ru.inference.cli import shown_text

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from examples.demo import shown_command  # noqa: E402


def test_echoed_commands_paste_into_a_shell():
    report = os.path.join(ROOT, "adapt_demo_out", "eval", "instruct (English tokenizer).json")
    cmd = [sys.executable, os.path.join(ROOT, "tools", "evaluate.py"), "--output-json", report, "--prompt", "it's"]
    line = shown_command(cmd)
    assert "'adapt_demo_out/eval/instruct (English tokenizer).json'" in line
    assert shlex.split(line)[1:] == ["tools/evaluate.py", "--output-json",
                                     "adapt_demo_out/eval/instruct (English tokenizer).json", "--prompt", "it's"]


def test_trailing_line_breaks_are_counted_not_printed():
    assert shown_text("Новости дня" + "\n" * 24) == "Новости дня\n[24 trailing line breaks]"
    assert shown_text("a\n\nb\n") == "a\n\nb"
    assert shown_text("a") == "a"


def test_deepspeed_accelerator_notice_is_a_debug_record():
    import logging

    import megatron_ru.utils.logging  # noqa: F401 - installs the filter on DeepSpeed's logger
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    ds, keep = logging.getLogger("DeepSpeed"), Keep()
    ds.addHandler(keep)
    try:
        ds.warning("Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.")
        ds.warning("something else")
    finally:
        ds.removeHandler(keep)
    assert seen == ["something else"]
