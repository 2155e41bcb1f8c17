"""Item 7 of issue 33: export-hf's report lists every file it wrote (the tokenizer's too), and what
the README's commands write in the repository is ignored by git."""
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from tests.fixtures.models import tiny_llama
from tests.fixtures.tokenizers import make_hf_tokenizer_dir

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: flags whose value is a path a README command writes
OUTPUT_FLAGS = ("--save", "--output-prefix", "--output", "--output-file", "--metrics-file", "--tensorboard-dir")


def test_export_report_lists_the_tokenizer_files(tmp_path, capsys):
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import convert_checkpoint
    finally:
        sys.path.pop(0)
    tok = make_hf_tokenizer_dir(str(tmp_path), vocab=300)
    hf = tiny_llama(str(tmp_path / "hf"), 300, tokenizer_dir=tok)
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    assert convert_checkpoint.main(["import-hf", "--load", hf, "--save", ckpt]) == 0
    capsys.readouterr()
    assert convert_checkpoint.main(["export-hf", "--load", ckpt, "--save", out]) == 0
    report = json.loads(capsys.readouterr().out)
    assert sorted(report["files"]) == sorted(os.listdir(out))
    assert "tokenizer.json" in report["files"]


def _readme_outputs() -> list[str]:
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    outputs = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip().startswith("#"):
                continue
            words = shlex.split(line, comments=True)
            outputs += [words[i + 1] for i, w in enumerate(words[:-1]) if w in OUTPUT_FLAGS]
    return [p for p in outputs if not os.path.isabs(p)]


def test_readme_outputs_are_ignored_by_git():
    if not os.path.isdir(os.path.join(ROOT, ".git")) and not os.path.isfile(os.path.join(ROOT, ".git")):
        pytest.fail(f"{ROOT} is not a git checkout: the test asks git which README outputs it ignores; "
                    f"run it in a clone")
    outputs = _readme_outputs()
    assert {"ckpt/llama3-8b", "data/ru", "hf/llama3-ru", "tok/bpe32k"} <= set(outputs)
    proc = subprocess.run(["git", "check-ignore", "--no-index", *outputs], cwd=ROOT, capture_output=True, text=True)
    ignored = set(proc.stdout.split())
    assert [p for p in outputs if p not in ignored] == []
    assert subprocess.run(["git", "check-ignore", "-q", "--no-index", "megatron_ru/data/builder.py"],
                          cwd=ROOT).returncode == 1  # /data/ is the root's only
