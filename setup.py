"""Builds megatron_ru and its pybind11 extensions: csrc/helpers.cpp → megatron_ru.data._helpers (dataset
indices) and csrc/jsonl.cpp → megatron_ru.data.preprocess._jsonl (JSONL fast path of preprocess_data.py).

A missing compiler, Python headers or pybind11 is reported in one line naming what to
install, before any compilation; a failing compile is summarised the same way.
"""
import os
import shutil
import sys
import sysconfig

from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext


def _fail(msg: str) -> None:
    sys.stderr.write(f"\nmegatron_ru: cannot build the C++ extensions (csrc/): {msg}\n\n")
    raise SystemExit(1)


def _preflight() -> None:
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx.split()[0]) is None and shutil.which("g++") is None:
        _fail(f"no C++ compiler found (tried $CXX={cxx!r} and g++). Install one: "
              "'apt-get install g++' (Debian/Ubuntu) or 'module load gcc' on a cluster.")
    include = sysconfig.get_paths()["include"]
    if not os.path.exists(os.path.join(include, "Python.h")):
        _fail(f"Python headers not found (no Python.h in {include}). Install them: "
              "'apt-get install python3-dev' or use a Python built with headers (pyenv, conda).")
    try:
        import pybind11  # noqa: F401
    except ImportError:
        _fail("pybind11 is not installed. Run 'pip install pybind11' (scripts/setup_env.sh does it) "
              "and build with --no-build-isolation.")


class QuietBuildExt(build_ext):
    """build_ext that checks prerequisites first and turns a compile failure into one line."""

    def run(self) -> None:
        _preflight()
        super().run()

    def build_extension(self, ext) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # CompileError/LinkError: the compiler already printed its log
            _fail(f"compiling {', '.join(ext.sources)} failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}). "
                  "A C++17 compiler (g++ >= 7) is required; see the compiler message above.")


def _extensions():
    try:
        from pybind11.setup_helpers import Pybind11Extension
    except ImportError:
        _preflight()
        raise
    return [
        Pybind11Extension(
            "megatron_ru.data._helpers",
            ["csrc/helpers.cpp"],
            cxx_std=17,
            extra_compile_args=["-O3"],
        ),
        Pybind11Extension(
            "megatron_ru.data.preprocess._jsonl",
            ["csrc/jsonl.cpp"],
            cxx_std=17,
            extra_compile_args=["-O3"],
        ),
    ]


setup(
    name="megatron_ru",
    version="0.1.0",
    description="Megatron-DeepSpeed-style 3D-parallel pretraining for GPT/LLaMA-family models",
    packages=find_packages(include=["megatron_ru", "megatron_ru.*"]),
    python_requires=">=3.9",
    ext_modules=_extensions(),
    cmdclass={"build_ext": QuietBuildExt},
    install_requires=[
        "torch>=2.1",
        "deepspeed>=0.19.8,<0.20",  # tested range: megatron_ru/deepspeed_bridge/compat.py
        "numpy>=1.24",
        "regex",
        "sentencepiece>=0.2.0",
        "pybind11>=2.11",
        "mpi4py>=3.1",
        "safetensors",
        "tensorboard",
    ],
    extras_require={"apex": ["apex"], "focus": ["fasttext-wheel>=0.9.2", "entmax>=1.3"],
                    "test": ["pytest", "pytest-timeout", "transformers"]},
    zip_safe=False,
)
