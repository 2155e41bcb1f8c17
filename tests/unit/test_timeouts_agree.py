"""pytest.ini's hang guard stays above every limit a test sets itself, so that limit (with its
clearer message: which rank, which job, which command) fires first. A module-level ``pytestmark`` with
``pytest.mark.timeout(N)`` sets the guard of that file's tests (lower, or higher for tool runs that take long
on a loaded machine); the file's limits then stay below N."""
from __future__ import annotations

import configparser
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# literal limits in seconds: subprocess/join timeouts and pytest-timeout marks
LIMIT = re.compile(r"\b(?:timeout|timeout_s)\s*=\s*(\d+)\b|mark\.timeout\(\s*(\d+)\s*\)")
FILE_GUARD = re.compile(r"^pytestmark\s*=.*mark\.timeout\(\s*(\d+)\s*\)", re.M)


def test_global_timeout_is_above_every_limit_a_test_sets():
    ini = configparser.ConfigParser()
    ini.read(REPO / "pytest.ini")
    global_s = int(ini["pytest"]["timeout"])
    from tests.integration.schedulers.system import APT_BUDGET_S

    found, guards = set(), {}
    for p in (REPO / "tests").rglob("*.py"):
        text, name = p.read_text(encoding="utf-8"), f"{p.relative_to(REPO)}"
        own = FILE_GUARD.search(text)
        if own:
            guards[name] = int(own.group(1))
            text = text.replace(own.group(0), "")
        found |= {(name, int(a or b)) for a, b in LIMIT.findall(text)}
    found.add(("tests/integration/schedulers/system.py (APT_BUDGET_S)", APT_BUDGET_S))
    assert any(s >= 900 for _, s in found)  # the scan does see the long ones
    too_long = sorted((s, f) for f, s in found if s >= guards.get(f, global_s))
    assert not too_long, f"the hang guard (pytest.ini timeout = {global_s} s, or the file's own) fires before these limits: {too_long}; raise it"
