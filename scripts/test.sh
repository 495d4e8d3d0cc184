#!/usr/bin/env bash
# Install everything the tests need on a fresh machine, then run the whole suite.
#   bash scripts/test.sh            the full suite (what CI runs): the fast lane in parallel,
#                                   then the rest (pytest --rest) in FLEET_REST_WORKERS (3)
#                                   workers, the browser's pages last, in two workers
#   bash scripts/test.sh --fast     the fast lane: no browser, no process fleets or fault loops,
#                                   no long fuzzing (tests/conftest.py says what it leaves out),
#                                   in FLEET_TEST_WORKERS (4) pytest-xdist workers
# Any other arguments go to pytest (a file, -k EXPR, -x, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

# Debian packages the tests drive: Chromium (pages, driven by Playwright with the system browser;
# no browser is downloaded), libfaketime (clock jumps), systemd-analyze (unit files) and chattr
# (an immutable database file).
packages=()
command -v chromium >/dev/null 2>&1 || packages+=(chromium)
command -v faketime >/dev/null 2>&1 || packages+=(faketime)
command -v systemd-analyze >/dev/null 2>&1 || packages+=(systemd)
command -v chattr >/dev/null 2>&1 || packages+=(e2fsprogs)
if [ "${#packages[@]}" -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    # A package that will not install leaves its tests skipped (each says why), not the run dead.
    { apt-get update -qq &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${packages[@]}" >/dev/null; } ||
      echo "scripts/test.sh: could not install ${packages[*]}; their tests will be skipped" >&2
  else
    echo "scripts/test.sh: cannot install ${packages[*]} (needs root and apt-get);" \
         "the tests that need them will be skipped" >&2
  fi
fi

# The test and dev tools and every dependency at the versions the suite passes with (see the
# file's header for how to refresh them on purpose).
python3 -m pip install --quiet --constraint constraints.txt --editable ".[test,fast]"
# The fast lane's tests mostly wait on sockets and child processes, so four workers fill two
# cores; work stealing moves the last long tests to idle workers instead of leaving one behind.
fast_lane() {
  python3 -m pytest --fast -n "${FLEET_TEST_WORKERS:-4}" --dist worksteal "$@"
}
if [ "${1:-}" = "--fast" ]; then
  shift
  fast_lane "$@"
  exit
fi
if [ "$#" -eq 0 ]; then
  # The full suite (CI): the fast lane, then the rest (process fleets, fault loops, long fuzzing,
  # the benchmarks' smoke runs), then the pages in Chromium. The rest wait mostly on child
  # processes and sockets and bound what they wait for generously (no test asserts a speed), so
  # they run in three workers; one at a time they took 16 minutes of CI's 30 on a slow hour
  # (docs/testing.md). The pages run in two workers: each drives a browser of its own.
  fast_lane
  python3 -m pytest --rest -m "not browser" -n "${FLEET_REST_WORKERS:-3}" --dist worksteal
  exec python3 -m pytest --rest -m browser -n 2 --dist load
fi
exec python3 -m pytest "$@"
