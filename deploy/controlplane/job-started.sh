#!/bin/sh
# fleet-min admission hook for GitHub Actions self-hosted runners
# (ACTIONS_RUNNER_HOOK_JOB_STARTED; install it with install-admission-hook.sh).
#
# Before each job starts it waits while this host is overloaded, then lets the job go.
# Overloaded: the 1-minute load average per core is above FLEET_ADMIT_MAX_LOAD, or less memory
# is available than FLEET_ADMIT_MIN_MEM_MB. Each decision is appended as one JSON line to
# FLEET_ADMISSION_LOG, which the fleet-min control plane reads (GET /api/admission):
#   admitted   the host was within its limits; the job starts at once
#   held       the host was overloaded; the job waits (one line when the wait begins)
#   released   the host is within its limits again; the job starts (wait_s: how long it waited)
#   timed_out  the wait reached FLEET_ADMIT_TIMEOUT_S; the job starts anyway, or fails with
#              FLEET_ADMIT_FAIL_ON_TIMEOUT=1
# Settings come from the environment (the runner's .env file): FLEET_ADMISSION_LOG
# (default ~/.config/fleet-min/admission.log), FLEET_ADMIT_MAX_LOAD (1.5),
# FLEET_ADMIT_MIN_MEM_MB (0: not checked), FLEET_ADMIT_TIMEOUT_S (600), FLEET_ADMIT_POLL_S (5).
# POSIX sh and awk only; the runner runs it with bash.
set -u

LOG=${FLEET_ADMISSION_LOG:-${HOME}/.config/fleet-min/admission.log}
MAX_LOAD=${FLEET_ADMIT_MAX_LOAD:-1.5}
MIN_MEM_MB=${FLEET_ADMIT_MIN_MEM_MB:-0}
TIMEOUT_S=${FLEET_ADMIT_TIMEOUT_S:-600}
POLL_S=${FLEET_ADMIT_POLL_S:-5}
LOADAVG=${FLEET_ADMIT_LOADAVG_FILE:-/proc/loadavg}
MEMINFO=${FLEET_ADMIT_MEMINFO_FILE:-/proc/meminfo}

cores() {
  if [ -n "${FLEET_ADMIT_CORES:-}" ]; then echo "$FLEET_ADMIT_CORES"; return; fi
  getconf _NPROCESSORS_ONLN 2>/dev/null || sysctl -n hw.ncpu 2>/dev/null || echo 1
}

load1() {
  if [ -r "$LOADAVG" ]; then cut -d' ' -f1 "$LOADAVG"; return; fi
  sysctl -n vm.loadavg 2>/dev/null | tr -d '{}' | awk '{print $1}'  # macOS
}

mem_available_mb() {
  if [ -r "$MEMINFO" ]; then awk '/^MemAvailable:/ {print int($2 / 1024)}' "$MEMINFO"; fi
}

per_core() {
  awk -v load="$(load1)" -v cores="$(cores)" 'BEGIN {
    if (cores < 1) cores = 1
    if (load == "") printf "null"; else printf "%.2f", load / cores }'
}

# Prints why the host is overloaded, or nothing when it is not.
overloaded() {
  awk -v per_core="$(per_core)" -v max="$MAX_LOAD" -v mem="$(mem_available_mb)" \
      -v min_mem="$MIN_MEM_MB" 'BEGIN {
    if (per_core != "null" && per_core + 0 > max + 0) {
      printf "load per core %s > %s", per_core, max; exit }
    if (mem != "" && min_mem + 0 > 0 && mem + 0 < min_mem + 0) {
      printf "available memory %d MB < %d MB", mem, min_mem; exit }
  }'
}

esc() { printf '%s' "$1" | tr -d '\000-\037' | sed 's/\\/\\\\/g; s/"/\\"/g'; }

record() {  # decision wait_s reason
  umask 077  # the log sits in the daemon's state directory: the owner's alone, like the rest
  mkdir -p "$(dirname "$LOG")"
  # One printf of one short line: an O_APPEND write the daemon never sees half of for long.
  printf '{"at":"%s","decision":"%s","wait_s":%s,"reason":"%s","load":%s,"runner":"%s","repo":"%s","run_id":"%s","job":"%s","workflow":"%s"}\n' \
    "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$1" "$2" "$(esc "$3")" "$(per_core)" \
    "$(esc "${RUNNER_NAME:-}")" "$(esc "${GITHUB_REPOSITORY:-}")" \
    "$(esc "${GITHUB_RUN_ID:-}")" "$(esc "${GITHUB_JOB:-}")" "$(esc "${GITHUB_WORKFLOW:-}")" \
    >> "$LOG"
}

reason=$(overloaded)
if [ -z "$reason" ]; then
  record admitted 0 "host within limits"
  exit 0
fi
record held 0 "$reason"
echo "fleet-min admission: holding the job: $reason"
started=$(date +%s)
while :; do
  sleep "$POLL_S"
  waited=$(( $(date +%s) - started ))
  reason=$(overloaded)
  if [ -z "$reason" ]; then
    record released "$waited" "host within limits again"
    echo "fleet-min admission: released after ${waited} s"
    exit 0
  fi
  if [ "$waited" -ge "$TIMEOUT_S" ]; then
    record timed_out "$waited" "$reason"
    echo "fleet-min admission: still overloaded after ${waited} s ($reason)"
    if [ "${FLEET_ADMIT_FAIL_ON_TIMEOUT:-0}" = 1 ]; then exit 1; fi
    exit 0
  fi
done
