#!/bin/bash
# Grid Engine queue starter_method reproducing ABCI's job environment: ABCI exports
# SGE_JOB_HOSTLIST (a file naming each host of the job once) and SGE_LOCALDIR (node-local
# scratch); plain Grid Engine has neither. Called with the job script and its arguments.
set -euo pipefail
scratch="${TMPDIR:-${TMP:-/tmp}}"
hostlist="${scratch}/sge_job_hostlist"
if [ -n "${PE_HOSTFILE:-}" ] && [ -r "${PE_HOSTFILE}" ]; then
  awk '!seen[$1]++ {print $1}' "${PE_HOSTFILE}" >"${hostlist}"
else
  hostname >"${hostlist}"
fi
export SGE_JOB_HOSTLIST="${hostlist}"
export SGE_LOCALDIR="${scratch}"
exec "$@"
