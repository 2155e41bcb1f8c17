"""Every shell script we ship (and the harness's own) is shellcheck-clean."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.integration.schedulers.system import apt_install

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted([*REPO.glob("scripts/**/*.sh"), *REPO.glob("scripts/**/*.sbatch"),
                  *REPO.glob("tests/integration/schedulers/*.sh"), REPO / "tests/integration/schedulers/bin/qsub"])


def test_scripts_found():
    names = {p.relative_to(REPO).as_posix() for p in SCRIPTS}
    assert {"scripts/abci/submit_multinode.sh", "scripts/abci/submit_single_node.sh", "scripts/abci/common.sh",
            "scripts/abci/settings.sh",
            "scripts/slurm/submit_pyxis.sbatch", "scripts/slurm/submit_torchrun.sbatch",
            "scripts/lib/launch.sh"} <= names


def test_shellcheck_clean():
    if shutil.which("shellcheck") is None:
        apt_install(["shellcheck"])
    # -x follows `source` lines (their `# shellcheck source=` paths are relative to the repo root)
    proc = subprocess.run(["shellcheck", "-x", "--severity=style", *map(str, SCRIPTS)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
