#!/usr/bin/env bash
# A before/after on one GPU in one device call: benchmarks/small_calls.py and a `flaggems bench --models` subset,
# first on an older tree, then on this one (same machine, same warm-up; each bench interleaves torch and flaggems
# itself, so compare the speedups). Prepare the older tree here, in the ignored folder .ab:
#   rm -rf .ab/before && mkdir -p .ab/before && git archive <commit> | tar -x -C .ab/before
# then run `bash benchmarks/before_after.sh` with carry [".whl", ".ab"]. MODELS picks the workloads (--only ...),
# SMALL_ROUNDS / MODELS_ROUNDS the rounds, SMALL_ARGS more small_calls.py options (--calls, --only),
# SMALL_T / MODELS_T each step's seconds.
set -uo pipefail
out=${OUT:-gpu-out}; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
MODELS=${MODELS:---only llama_decode_b1_static --only qwen2_decode_b1_static --only llama_prefill_512 --only llama_generate}
side() {  # tree label
  python3 -m pip uninstall -q -y flaggems flaggems-core flaggems-ascend flaggems-kunlunxin flaggems-hygon >/dev/null 2>&1
  (cd "$1" && python3 -m pip install -q --no-deps --no-build-isolation -e . -e flaggems_ascend -e flaggems_kunlunxin -e flaggems_hygon) >"$out/install_$2.log" 2>&1 || { tail -5 "$out/install_$2.log"; return 1; }
  (cd /tmp && python3 -c "import flaggems, os; print('$2 flaggems from', os.path.dirname(flaggems.__file__))")
  (cd /tmp && timeout 200 python3 -m flaggems build 2>&1 | tail -1)
  (cd "$1" && timeout ${SMALL_T:-110} python3 benchmarks/small_calls.py --rounds ${SMALL_ROUNDS:-5} ${SMALL_ARGS:-} --json "$out/small_$2.json" >"$out/small_$2.log" 2>&1; echo "$2 small exit $?")
  (cd "$1" && timeout ${MODELS_T:-150} python3 -m flaggems bench --models $MODELS --rounds ${MODELS_ROUNDS:-6} --side flaggems --side patched --json "$out/models_$2.json" >"$out/models_$2.log" 2>&1; echo "$2 models exit $?")
}
side "$PWD/.ab/before" before
side "$PWD" after
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
def rows(name):
    try: return json.load(open(f"{out}/{name}"))
    except Exception as e: print(name, "missing", e); return None
for label in ("before", "after"):
    d = rows(f"small_{label}.json")
    if d:
        for r in d["rows"]:
            print(label, "small", {k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items() if k.endswith(("wall_us", "kernel_us", "_vs_torch")) or k in ("workload", "ok")})
PY
tail -25 "$out/models_before.log"; tail -25 "$out/models_after.log"
