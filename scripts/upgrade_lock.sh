#!/usr/bin/env bash
# Upgrade the lock: the newest release of every dependency into a fresh venv, the whole suite
# against them, and only if it passes, constraints.txt rewritten from what was installed.
#   bash scripts/upgrade_lock.sh            (about 15 minutes on 2 cores: install, then the suite)
# The venv is left in .venv-upgrade for a failure's investigation. torch stays setup.sh's pin
# (MSTRACE_TORCH_VERSION) and is not in the lock: its build (CPU or CUDA) is the machine's.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-upgrade
rm -rf "$venv"
start=$(date +%s)
MSTRACE_VENV=$venv bash setup.sh --test --upgrade
echo "upgrade_lock: unlocked install took $(( $(date +%s) - start )) s"
"$venv/bin/python" -m pytest -q
{
  echo "# The versions the whole suite last passed on: setup.sh installs with -c constraints.txt."
  echo "# Made by scripts/upgrade_lock.sh on $(date -u +%Y-%m-%d) (Python $("$venv/bin/python" -c 'import platform; print(platform.python_version())'), $(uname -sm))."
  echo "# torch is setup.sh's pin, not here. Local version labels (+cpu) are dropped: a constraint"
  echo "# without one admits every build of that version."
  "$venv/bin/python" -m pip freeze --exclude-editable --disable-pip-version-check \
    | grep -v -i -E '^(torch|mstrace)==' | sed -E 's/\+[A-Za-z0-9.]+$//'
} > constraints.txt.new
mv constraints.txt.new constraints.txt
echo "upgrade_lock: suite passed; constraints.txt rewritten ($(grep -c '==' constraints.txt) pins); review with git diff"
