"""Item 12 of issue 33: `make test-fast` runs what is not marked slow, and what runs tools, ranks or
schedulers is marked slow (tests/conftest.py checks the fast suite's budget when it runs)."""
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: integration tests fast enough for the edit-test loop (one rank in a few seconds)
FAST_FILES = {"tests/integration/test_golden_loss.py"}


def _all_slow(source: str) -> bool:
    """The module is marked slow, or every test function in it is."""
    if re.search(r"^pytestmark = \[?pytest\.mark\.slow", source, re.M):
        return True
    lines = source.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("def test_"):
            decorators = []
            j = i - 1
            while j >= 0 and (lines[j].startswith("@") or lines[j].startswith((" ", ")", "]"))):
                decorators.append(lines[j])
                j -= 1
            if not any("pytest.mark.slow" in d for d in decorators):
                return False
    return True


def test_make_test_fast_runs_the_not_slow_set():
    makefile = open(os.path.join(ROOT, "Makefile"), encoding="utf-8").read()
    recipe = re.search(r"^test-fast:.*\n\t(.*)$", makefile, re.M)
    assert recipe and '-m "not slow" tests' in recipe.group(1)


def test_integration_and_distributed_files_are_marked_slow():
    files = sorted(glob.glob(os.path.join(ROOT, "tests", "integration", "test_*.py"))
                   + glob.glob(os.path.join(ROOT, "tests", "distributed", "test_*.py")))
    unmarked = [os.path.relpath(f, ROOT) for f in files if not _all_slow(open(f, encoding="utf-8").read())]
    assert sorted(set(unmarked) - FAST_FILES) == [], "add pytestmark = pytest.mark.slow (or list it as fast here)"


def test_test_file_names_are_unique():
    """tests/unit and tests/integration have no __init__.py: two test files of one name stop every run that
    collects both ("import file mismatch"), make test and make test-fast included."""
    names: dict[str, list[str]] = {}
    for path in glob.glob(os.path.join(ROOT, "tests", "**", "test_*.py"), recursive=True):
        names.setdefault(os.path.basename(path), []).append(os.path.relpath(path, ROOT))
    assert not {n: p for n, p in names.items() if len(p) > 1}


def test_the_scheduler_tests_share_one_worker():
    """Under xdist every test that brings up Slurm or Grid Engine (their fixtures) runs on the machine's one
    worker, whatever file it is in; so do the files that apt-install beside them; the rest go by file."""
    from pathlib import Path
    from types import SimpleNamespace

    from tests.conftest import MACHINE_FILES, _on_the_machine

    def item(name: str, *fixtures: str) -> SimpleNamespace:
        return SimpleNamespace(path=Path(ROOT, "tests", "integration", name), fixturenames=["tmp_path", *fixtures])

    assert _on_the_machine(item("test_a_new_scheduler_file.py", "slurm_cluster"))
    assert _on_the_machine(item("test_a_new_scheduler_file.py", "grid_engine", "tiny_corpus"))
    assert all(_on_the_machine(item(name)) for name in MACHINE_FILES)
    assert not _on_the_machine(item("test_train_layouts.py", "tiny_corpus"))
