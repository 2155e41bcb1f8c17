"""The import contracts in ``.importlinter`` hold: DeepSpeed is imported only by megatron_ru.deepspeed_bridge,
the training stack's layers import only downward, the config schema imports nothing above it.
``lint-imports`` (PyPI ``import-linter``, installed by ``make install``) checks imports inside functions
and under TYPE_CHECKING too."""
from __future__ import annotations

import configparser
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(REPO, ".importlinter")
BRIDGE = "megatron_ru.deepspeed_bridge"


def _lint_imports() -> str:
    exe = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    assert os.path.exists(exe), (f"{exe} not found: install import-linter into this environment "
                                 f"(make install does, from requirements.txt)")
    return exe


def test_import_contracts_hold() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    # run in the repository root: lint-imports reads .importlinter from there
    proc = subprocess.run([_lint_imports(), "--no-cache"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    broken = out[out.find("Broken contracts"):] if "Broken contracts" in out else out[-6000:]
    assert proc.returncode == 0, (
        f"an import contract in .importlinter is broken (lint-imports exit {proc.returncode}). DeepSpeed is "
        f"imported only in {BRIDGE} (call its functions instead); a layer imports only from the layers below "
        f"it (move the code down, or pass what it needs in). What broke:\n{broken}")


def test_every_package_but_the_bridge_is_forbidden_deepspeed() -> None:
    """A new top-level package of megatron_ru is covered by the DeepSpeed contract from its first commit."""
    parser = configparser.ConfigParser()
    parser.read(CONFIG)
    sources = set(parser["importlinter:contract:deepspeed-behind-its-bridge"]["source_modules"].split())
    root = os.path.join(REPO, "megatron_ru")
    top = {f"megatron_ru.{name[:-3] if name.endswith('.py') else name}" for name in os.listdir(root)
           if (name.endswith(".py") and name != "__init__.py")
           or os.path.isfile(os.path.join(root, name, "__init__.py"))}
    assert top - {BRIDGE} == sources, (
        f"the forbidden-deepspeed contract in .importlinter must list every top-level module of megatron_ru but "
        f"{BRIDGE}: add {sorted(top - {BRIDGE} - sources)}, remove {sorted(sources - top)}")
