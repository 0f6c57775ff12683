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
# Each vendor plugin on its own backend: simulated here unless this machine has that vendor's device.
for spec in "ascend index_copy" "kunlunxin copy_" "hygon repeat_interleave"; do
  set -- $spec
  echo "== FLAGGEMS_VENDOR=$1: its routes and workloads"
  FLAGGEMS_VENDOR=$1 "$venv/bin/flaggems" info | grep -E "^backend|^tuning|^  [a-z_]+: \{" || true
  FLAGGEMS_VENDOR=$1 "$venv/bin/flaggems" routes | grep -A3 -E "^($2|copy_|_to_copy)[.:]" || true
  FLAGGEMS_VENDOR=$1 "$venv/bin/python" examples/demo.py --only "$2"
done
