#!/usr/bin/env bash
# Installs everything megatron_ru needs into one virtual environment (default: .venv).
# Idempotent: a second run installs nothing new. Safe on clusters: torch is installed only
# when absent (NGC containers and module systems bring their own), and every later pip call
# is constrained to the torch that is present so nothing pulls a CUDA build behind our back.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-${ROOT}/.venv}"
PY_BOOT="${PYTHON_BOOT:-python3}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
DEEPSPEED_VERSION="${DEEPSPEED_VERSION:-0.19.8}"
STAMP="${VENV}/.megatron_ru_installed"

log() { printf '[setup_env] %s\n' "$*" >&2; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; elif command -v sudo >/dev/null 2>&1; then sudo "$@"; else
    log "need root for: $*  (install it yourself or run as root)"; return 1; fi
}

apt_install() {
  if ! command -v apt-get >/dev/null 2>&1; then
    log "apt-get not found: install $* with your system's package manager"; return 1
  fi
  if [ ! -f /tmp/.megatron_ru_apt_updated ]; then
    as_root apt-get update -qq && touch /tmp/.megatron_ru_apt_updated
  fi
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# 1. System packages: Open MPI (mpirun + headers for mpi4py) when mpirun is absent.
if ! command -v mpirun >/dev/null 2>&1; then
  log "mpirun not found: installing Open MPI from the system package manager"
  apt_install openmpi-bin libopenmpi-dev
fi

# 2. The virtual environment. --system-site-packages keeps a container's torch visible.
if [ ! -x "${VENV}/bin/python" ]; then
  log "creating ${VENV}"
  "${PY_BOOT}" -m venv --system-site-packages "${VENV}"
fi
PY="${VENV}/bin/python"
PIP=("${PY}" -m pip install --disable-pip-version-check -q)
# An old pip (23.x) turns editable installs into the deprecated 'setup.py develop' path.
"${PY}" -c 'import sys, pip; sys.exit(int(pip.__version__.split(".")[0]) < 24)' || "${PIP[@]}" 'pip>=24'

if [ -f "${STAMP}" ] && [ "$(cat "${STAMP}")" = "$(cat "${ROOT}/setup.py" "${ROOT}/csrc/"*.cpp "${ROOT}/requirements.txt" | cksum)" ]; then
  log "environment up to date (${VENV})"
  exit 0
fi

# 3. torch only if absent (a CPU build here; clusters bring their own CUDA build).
if ! "${PY}" -c 'import torch' >/dev/null 2>&1; then
  log "torch not found: installing torch==${TORCH_VERSION}"
  "${PIP[@]}" "torch==${TORCH_VERSION}"
fi
CONSTRAINTS="${VENV}/torch-constraints.txt"
"${PY}" -c 'import torch; print("torch==" + torch.__version__)' >"${CONSTRAINTS}"
log "pinned $(cat "${CONSTRAINTS}") for every later install"

# 4. Build tools and plain dependencies, then DeepSpeed without build isolation.
"${PIP[@]}" -c "${CONSTRAINTS}" -r "${ROOT}/requirements.txt"
if ! "${PY}" -c 'import deepspeed' >/dev/null 2>&1; then
  log "installing deepspeed==${DEEPSPEED_VERSION} (no build isolation)"
  "${PIP[@]}" -c "${CONSTRAINTS}" --no-build-isolation "deepspeed==${DEEPSPEED_VERSION}"
fi

# 5. The package itself, with its C++ extensions (csrc/), in place (editable).
log "building megatron_ru and its C++ extensions"
"${PIP[@]}" -c "${CONSTRAINTS}" --no-build-isolation --no-deps -e "${ROOT}"

cat "${ROOT}/setup.py" "${ROOT}/csrc/"*.cpp "${ROOT}/requirements.txt" | cksum >"${STAMP}"
log "done: activate with 'source ${VENV}/bin/activate'"
