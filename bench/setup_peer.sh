#!/usr/bin/env bash
# Create the benchmark-only virtualenv with the peer engine (DBOS Transact).
# DBOS is never a dependency of tether: it lives in bench/.peer-venv (git-ignored)
# and is only run as a subprocess by `bench/run.py --peer`.
#
#   bash bench/setup_peer.sh            # from the repository root
#   PYTHON=python3.12 bash bench/setup_peer.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="$here/.peer-venv"
python="${PYTHON:-python3}"
version="${DBOS_VERSION:-3.4.*}"
if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet "dbos==$version"
"$venv/bin/python" -c "import importlib.metadata as m; print('dbos', m.version('dbos'), 'in', '$venv')"
