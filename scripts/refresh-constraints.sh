#!/usr/bin/env bash
# Refresh constraints.txt on purpose: resolve the newest releases that pyproject.toml admits into a
# clean virtual environment, write their exact versions to constraints.txt, and run the whole suite
# with them. Commit the new constraints.txt only when the run passes; otherwise `git checkout
# constraints.txt` and bound the package that broke in pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
venv="$(mktemp -d)/venv"
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet ".[test,fast]"
{
  sed -n '/^#/p' constraints.txt
  "$venv/bin/python" -m pip freeze --exclude fleet-min | tr 'A-Z_' 'a-z-' | sort
} > constraints.txt.new
mv constraints.txt.new constraints.txt
git --no-pager diff --stat -- constraints.txt || true
"$venv/bin/python" -m pip install --quiet --no-deps --editable .
(. "$venv/bin/activate" && python3 -m pytest "$@")
