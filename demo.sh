#!/usr/bin/env bash
# The demo: install flaggems-core and the three vendor plugins in a fresh venv,
# show the discovered plugins and routes, run the seed workloads through
# flaggems (on CPU via the Triton interpreter when there is no GPU).
set -euo pipefail
cd "$(dirname "$0")"
venv=${DEMO_VENV:-.venv-demo}
python3 -m venv --system-site-packages "$venv"
"$venv/bin/python" tools/tox_install.py -q -e . -e flaggems_ascend -e flaggems_kunlunxin -e flaggems_hygon
echo "== flaggems info"
"$venv/bin/flaggems" info
echo "== flaggems routes"
"$venv/bin/flaggems" routes
echo "== seed workloads through flaggems"
"$venv/bin/python" examples/demo.py
