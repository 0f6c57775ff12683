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
echo "(the first enable() builds flaggems' compiled C++ entry once per torch version: about 40-80 s on two CPU cores, cached after that; it is not a hang)"
"$venv/bin/python" examples/demo.py
# Each vendor plugin on its own backend: simulated here unless this machine has that vendor's device.
# Per vendor: the ops whose routes it changes, then the demo workloads of its seed.
declare -A ROUTES=([ascend]="index_copy index_copy_ copy_ _to_copy" [kunlunxin]="copy_"
                   [hygon]="repeat_interleave.Tensor repeat_interleave.self_Tensor index_select")
declare -A WORKLOADS=([ascend]="index_copy" [kunlunxin]="copy_" [hygon]="repeat_interleave")
for vendor in ascend kunlunxin hygon; do
  echo "== FLAGGEMS_VENDOR=$vendor: its routes and workloads"
  FLAGGEMS_VENDOR=$vendor "$venv/bin/flaggems" info | grep -E "^backend|^tuning|^  [a-z_]+: \{" || true
  for op in ${ROUTES[$vendor]}; do FLAGGEMS_VENDOR=$vendor "$venv/bin/flaggems" routes --op "$op"; done
  FLAGGEMS_VENDOR=$vendor "$venv/bin/python" examples/demo.py --only "${WORKLOADS[$vendor]}"
done
