#!/bin/sh
# Install (or remove) the fleet-min admission hook for GitHub Actions runners.
#
#   install-admission-hook.sh [--log FILE] RUNNER_DIR...     install for these runners
#   install-admission-hook.sh --uninstall RUNNER_DIR...      remove it again
#
# Copies job-started.sh (next to this script) to $FLEET_HOOK_DIR (default
# ~/.config/fleet-min/hooks) and sets ACTIONS_RUNNER_HOOK_JOB_STARTED in each runner's .env,
# replacing an earlier value and keeping every other line. --log sets FLEET_ADMISSION_LOG there
# too (default: ~/.config/fleet-min/admission.log, where the control plane looks unless
# FLEET_ADMISSION_LOG tells it otherwise). A runner reads .env when it starts: restart its
# service afterwards (or drain and resume it from the control plane). .env keeps its mode
# (a new one is made 0600), and a value with a newline or another control character is refused.
set -eu

usage() {
  sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'
}

here=$(cd "$(dirname "$0")" && pwd)
dest=${FLEET_HOOK_DIR:-${HOME}/.config/fleet-min/hooks}
log=""
uninstall=0
while [ $# -gt 0 ]; do
  case "$1" in
    --log) [ $# -ge 2 ] || { usage >&2; exit 2; }; log=$2; shift 2 ;;
    --uninstall) uninstall=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    -*) echo "install-admission-hook: unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
done
[ $# -ge 1 ] || { usage >&2; exit 2; }

hook="$dest/job-started.sh"
# Each value becomes one line of .env: a newline in it would add lines of its own choosing
# (LD_PRELOAD=...) to the runner's environment.
refuse_control() {
  case $2 in
    *[[:cntrl:]]*)
      echo "install-admission-hook: $1 contains a newline or another control character;" \
        "refused (it would become more than one line of .env)" >&2
      exit 2 ;;
  esac
}
refuse_control "--log" "$log"
refuse_control "the hook directory (FLEET_HOOK_DIR, or HOME)" "$hook"
if [ "$uninstall" = 0 ]; then
  mkdir -p "$dest"
  cp "$here/job-started.sh" "$hook.new"
  chmod 755 "$hook.new"
  mv -f "$hook.new" "$hook"
fi

status=0
for dir in "$@"; do
  if [ ! -f "$dir/.runner" ]; then
    echo "$dir: not a configured runner (no .runner file); skipped" >&2
    status=1
    continue
  fi
  env_file="$dir/.env"
  new="$env_file.fleet-new"
  [ -e "$env_file" ] || (umask 077 && : > "$env_file")
  # The copy takes .env's mode (it may hold secrets) before the new lines go into it; rm first,
  # so a leftover or a link at that name is replaced, not written through.
  rm -f "$new"
  cp -p "$env_file" "$new"
  grep -v -e '^ACTIONS_RUNNER_HOOK_JOB_STARTED=' -e '^FLEET_ADMISSION_LOG=' "$env_file" \
    > "$new" || true
  if [ "$uninstall" = 0 ]; then
    echo "ACTIONS_RUNNER_HOOK_JOB_STARTED=$hook" >> "$new"
    if [ -n "$log" ]; then echo "FLEET_ADMISSION_LOG=$log" >> "$new"; fi
    echo "$dir: admission hook installed"
  else
    echo "$dir: admission hook removed"
  fi
  mv -f "$new" "$env_file"
done
echo "Restart each runner's service so it reads its .env again."
exit "$status"
