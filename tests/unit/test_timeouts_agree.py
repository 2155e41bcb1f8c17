"""pytest.ini's hang guard stays above every limit a test sets itself, so that limit (with its
clearer message: which rank, which job, which command) fires first."""
from __future__ import annotations

import configparser
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# literal limits in seconds: subprocess/join timeouts and pytest-timeout marks
LIMIT = re.compile(r"\b(?:timeout|timeout_s)\s*=\s*(\d+)\b|mark\.timeout\(\s*(\d+)\s*\)")


def test_global_timeout_is_above_every_limit_a_test_sets():
    ini = configparser.ConfigParser()
    ini.read(REPO / "pytest.ini")
    global_s = int(ini["pytest"]["timeout"])
    from tests.integration.schedulers.system import APT_BUDGET_S

    found = {(f"{p.relative_to(REPO)}", int(a or b)) for p in (REPO / "tests").rglob("*.py")
             for a, b in LIMIT.findall(p.read_text(encoding="utf-8"))}
    found.add(("tests/integration/schedulers/system.py (APT_BUDGET_S)", APT_BUDGET_S))
    assert any(s >= 900 for _, s in found)  # the scan does see the long ones
    too_long = sorted((s, f) for f, s in found if s >= global_s)
    assert not too_long, f"pytest.ini timeout = {global_s} s fires before these limits: {too_long}; raise it"
