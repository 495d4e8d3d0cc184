#!/usr/bin/env bash
# Install everything the tests need on a fresh machine, then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
python3 -m pip install --quiet --editable ".[test,fast]"
exec python3 -m pytest "$@"
