#!/usr/bin/env bash
# One device call (the `device` tool): install flaggems on the GPU machine's own
# torch, run the test suite on the GPU, measure the hot path and run the benchmark.
#   bash benchmarks/gpu_checks.sh [pytest selection...]
# Writes logs and JSON under $OUT (or ./gpu-out). stevedore comes from .whl/.
# STEPS picks what runs (default "tests hot_path bench"; also "small" (benchmarks/small_calls.py),
# "models" (flaggems bench --models), "fuzz" (benchmarks/fuzz_fused.py, in the background beside the next
# steps), "compile" (benchmarks/compile_checks.py checks), "compile_timings" (its timings),
# "host_layer" (benchmarks/host_per_layer.py), "probe" (benchmarks/probe.py), "new_shapes" (benchmarks/new_shapes.py),
# "kit" (the randomized conformance kit,
# KIT_CASES per op, generic and each vendor simulated) and "vendors": each vendor's tests and
# conformance kit simulated on this GPU, and its bench rows against the generic route or tuning).
# KIT_JOBS > 1 runs the kit as one process per (op, implementation), that many at once (KIT_WALL=s: each
# process's seconds chosen so every wave ends within s; the logs are packed at the end); "distributed": the
# two-GPU tests and benchmarks/distributed.py (nvidia-h200-x2).
# MODELS_ARGS and BENCH_ARGS pass options to `flaggems bench --models` and `flaggems bench` (e.g. --only, --op).
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . -e flaggems_ascend -e flaggems_kunlunxin -e flaggems_hygon \
  >"$out/install.log" 2>&1 || { tail -20 "$out/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 -m flaggems info
steps=" ${STEPS:-tests hot_path bench} "
if [[ $steps == *" fuzz "* || $steps == *" compile"* ]]; then
  timeout 240 python3 -m flaggems build 2>&1 | tail -1  # once, before several processes would wait on it
fi
if [[ $steps == *" tests "* ]]; then
echo "== pytest"
FLAGGEMS_CHECK_INDICES=1 timeout ${TEST_TIMEOUT:-330} python3 -m pytest -q -p no:cacheprovider --maxfail=25 \
  --ignore=tests/test_packaging.py "${@:-tests}" >"$out/pytest.log" 2>&1
echo "pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$out/pytest.log" | tail -30
fi
if [[ $steps == *" vendors "* ]]; then
echo "== vendors (simulated on this GPU)"
for v in ${VENDOR_TESTS:-ascend kunlunxin hygon}; do
  FLAGGEMS_VENDOR=$v FLAGGEMS_CHECK_INDICES=1 timeout ${VENDOR_TEST_TIMEOUT:-300} python3 -m pytest -q \
    -p no:cacheprovider tests/test_vendor_$v.py tests/test_conformance.py >>"$out/vendors_pytest.log" 2>&1
  echo "$v pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$out/vendors_pytest.log" | tail -6
done
for spec in "ascend --op index_copy --route generic" "kunlunxin --op copy_ --route untuned" \
            "hygon --op repeat_interleave --op index_select --route untuned"; do
  set -- $spec; v=$1; shift
  FLAGGEMS_VENDOR=$v timeout ${VENDOR_BENCH_TIMEOUT:-200} python3 -m flaggems bench "$@" \
    --json "$out/bench_$v.json" >>"$out/vendors_bench.log" 2>&1
  echo "$v bench exit $?"
done
FLAGGEMS_VENDOR=hygon timeout 120 python3 benchmarks/probe.py --only repeat_kernels --json "$out/probe_hygon.json" \
  >>"$out/vendors_bench.log" 2>&1
echo "hygon probe exit $?"; grep -E "speedup|geomean|repeat kernels" "$out/vendors_bench.log" | tail -40
fi
if [[ $steps == *" kit "* && ${KIT_JOBS:-1} -gt 1 ]]; then
echo "== randomized conformance kit: one process per op and implementation, $KIT_JOBS at a time"
# a vendor's own implementations (generic: all), and the generic kernels a vendor configures (KIT_TUNED:
# kunlunxin's elementwise grid reaches the strided copies, hygon's 64-wide wavefront the scan and gathers)
export KIT_TUNED=${KIT_TUNED-"kunlunxin:copy_ kunlunxin:_to_copy kunlunxin:index_copy kunlunxin:index_copy_
  hygon:repeat_interleave.self_int hygon:repeat_interleave.Tensor hygon:repeat_interleave.self_Tensor
  hygon:index_select"}
for v in ${KIT_VENDORS:-generic ascend kunlunxin hygon}; do
  FLAGGEMS_VENDOR=${v/generic/} python3 -c "import os; from flaggems.testing import random_cases as r
tuned = os.environ['KIT_TUNED'].split()
for op, label in sorted({(t.op, t.label) for t in r.targets()}):
    print('$v', op, label) if '$v' == 'generic' or label != 'generic' or f'$v:{op}' in tuned else None"
done >"$out/kit_targets.txt"
# KIT_SHARDS="op=k ..." runs a slow op as k processes of KIT_CASES/k cases each, seeds KIT_SEED..KIT_SEED+k-1
# (different cases; benchmarks/kit_tally.py sums them); other ops as one process of seed KIT_SEED
while read -r v op label; do
  [[ -n ${KIT_ONLY:-} && " $KIT_ONLY " != *" $op "* ]] && continue  # KIT_ONLY="op ...": only these ops
  k=1; for pair in ${KIT_SHARDS:-}; do [[ ${pair%=*} == "$op" && $label == generic ]] && k=${pair#*=}; done
  for ((i = 0; i < k; i++)); do echo "$v $op $label $((${KIT_SEED:-0} + i)) $(((${KIT_CASES:-10000} + k - 1) / k))"; done
done <"$out/kit_targets.txt" >"$out/kit_tasks.txt"
python3 -m flaggems build  # once, before the processes that would each wait on the first one's build
if [[ -n ${KIT_WALL:-} ]]; then  # KIT_WALL=s: the whole step in s seconds, however many waves of KIT_JOBS it takes
  waves=$(( ($(wc -l <"$out/kit_tasks.txt") + KIT_JOBS - 1) / KIT_JOBS ))
  KIT_SECONDS=$(( KIT_WALL / waves - 40 )); KIT_TIMEOUT=$(( KIT_SECONDS + 30 ))
  echo "kit: $(wc -l <"$out/kit_tasks.txt") processes in $waves waves of $KIT_JOBS, $KIT_SECONDS s each"
fi
export out KIT_CASES=${KIT_CASES:-10000} KIT_SECONDS=${KIT_SECONDS:-400} KIT_TIMEOUT=${KIT_TIMEOUT:-450} KIT_ARGS=${KIT_ARGS:-}
# one thread per process (16 processes share the cores); KIT_PROFILE=1: each process under cProfile
export OMP_NUM_THREADS=1 KIT_PROFILE=${KIT_PROFILE:-}
xargs -P "$KIT_JOBS" -L 1 bash -c 'name=kit_$0_${1//[:.]/_}_$2_s$3; prof=(); [[ -n $KIT_PROFILE ]] && \
  prof=(-m cProfile -o "$out/$name.prof"); FLAGGEMS_VENDOR=${0/generic/} FLAGGEMS_CHECK_INDICES=1 timeout $KIT_TIMEOUT \
  python3 "${prof[@]}" -m flaggems kit --op $1 --impl $2 --seed $3 --cases $4 --entry compiled \
  --seconds $KIT_SECONDS $KIT_ARGS >"$out/$name.log" 2>&1; echo "$0 $1 $2 seed $3 exit $?"' <"$out/kit_tasks.txt"
grep -h -E "FAILED|Error" "$out"/kit_*.log | sort | uniq | head -40
python3 benchmarks/kit_tally.py "$out"/kit_*.log | tee "$out/kit_tally.txt"
if [[ -n $KIT_PROFILE ]]; then python3 benchmarks/kit_profile.py "$out"/kit_*.prof >"$out/kit_profile.txt"; \
  head -120 "$out/kit_profile.txt"; fi
tar czf "$out/kit_logs.tgz" -C "$out" $(cd "$out" && ls kit_*.log kit_*.prof 2>/dev/null) && \
  rm -f "$out"/kit_*.log "$out"/kit_*.prof  # 8 files come back
elif [[ $steps == *" kit "* ]]; then
echo "== randomized conformance kit (KIT_CASES per op and implementation, direct and compiled entry)"
for v in ${KIT_VENDORS:-generic ascend kunlunxin hygon}; do
  vendor=$v; [[ $v == generic ]] && vendor=""
  FLAGGEMS_VENDOR=$vendor FLAGGEMS_CHECK_INDICES=1 timeout ${KIT_TIMEOUT:-150} python3 -m flaggems kit \
    --cases ${KIT_CASES:-10000} --entry compiled --seconds ${KIT_SECONDS:-20} ${KIT_ARGS:-} >"$out/kit_$v.log" 2>&1
  echo "$v kit exit $?"; grep -E "passed|warning|FAILED" "$out/kit_$v.log" | tail -40
done
fi
if [[ $steps == *" distributed "* ]]; then
echo "== two GPUs: tests/test_two_gpus.py, then benchmarks/distributed.py (tensor parallel, FSDP) over NCCL"
timeout ${DIST_TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider tests/test_two_gpus.py \
  tests/test_distributed.py >"$out/two_gpus.log" 2>&1
echo "two-GPU tests exit $?"; grep -E "^(FAILED|ERROR)|passed|failed|skipped" "$out/two_gpus.log" | tail -20
timeout ${DIST_TIMEOUT:-300} torchrun --standalone --nproc-per-node 2 benchmarks/distributed.py --device cuda \
  --json "$out/distributed.json" >"$out/distributed.log" 2>&1
echo "distributed exit $?"; grep -v -i warn "$out/distributed.log" | tail -12
fi
if [[ $steps == *" probe "* ]]; then
echo "== probe"
timeout ${PROBE_TIMEOUT:-300} python3 benchmarks/probe.py --json "$out/probe.json" ${PROBE_ONLY:+--only $PROBE_ONLY} \
  >"$out/probe.log" 2>&1
echo "probe exit $?"
fi
if [[ $steps == *" new_shapes "* ]]; then
echo "== new shapes (a never-seen size at every call)"
timeout ${NEW_SHAPES_TIMEOUT:-240} python3 benchmarks/new_shapes.py --calls ${NEW_SHAPES_CALLS:-1200} \
  --json "$out/new_shapes.json" >"$out/new_shapes.log" 2>&1
echo "new_shapes exit $?"; grep -v "^    " "$out/new_shapes.log" | tail -12
fi
if [[ $steps == *" hot_path "* ]]; then
echo "== hot path"
timeout 120 python3 benchmarks/hot_path.py --json "$out/hot_path.json"
fi
if [[ $steps == *" small "* ]]; then
echo "== small calls"
timeout ${SMALL_TIMEOUT:-240} python3 benchmarks/small_calls.py --json "$out/small_calls.json"
fi
if [[ $steps == *" models "* ]]; then
echo "== models"
timeout ${MODELS_TIMEOUT:-300} python3 -m flaggems bench --models ${MODELS_ARGS:-} --json "$out/models.json" >"$out/models.log" 2>&1
echo "models exit $?"; tail -40 "$out/models.log"
fi
if [[ $steps == *" bench "* ]]; then
echo "== bench"
timeout ${BENCH_TIMEOUT:-300} python3 -m flaggems bench ${BENCH_ARGS:-} --json "$out/bench.json" --plot "$out/bench.png" >"$out/bench.log" 2>&1
echo "bench exit $?"; tail -80 "$out/bench.log"
fi
if [[ $steps == *" fuzz "* ]]; then
echo "== fused ops against float64 in the background: FUZZ_PLAN (op:entry:start:cases:shards ..., entry compiled,"
echo "   python or both; default every"
echo "   op and entry, cases 0..FUZZ_CASES, one process each); a shard is a range of the same case sequence"
mkdir -p "$out/fuzz"
plan=${FUZZ_PLAN:-}
if [[ -z $plan ]]; then
  for op in rms_norm add_rms_norm rotary_embedding silu_mul gelu_tanh_mul gelu_mul group_norm_silu; do
    for entry in compiled python; do plan+=" $op:$entry:0:${FUZZ_CASES:-10000}:1"; done
  done
fi
for item in $plan; do
  IFS=: read -r op entry first cases shards <<<"$item"
  per=$(( (cases + shards - 1) / shards ))
  for ((k = 0; k < shards; k++)); do
    s0=$(( first + k * per )); n=$(( per < first + cases - s0 ? per : first + cases - s0 ))
    entries="--entry $entry"; [[ $entry == both ]] && entries="--entry compiled --entry python"  # one process:
    # the second entry finds the first's kernels compiled (group_norm_silu: ~1.7 cases/s while it compiles)
    timeout ${FUZZ_TIMEOUT:-540} nice -n 10 python3 benchmarks/fuzz_fused.py --op $op $entries --start $s0 --cases $n \
      ${FUZZ_ARGS:-} --json "$out/fuzz/${op}_${entry}_$s0.json" >"$out/fuzz/${op}_${entry}_$s0.log" 2>&1 &
  done
done
fi
if [[ $steps == *" compile "* ]]; then
echo "== torch.compile modes, static-cache generate, CUDA graphs (benchmarks/compile_checks.py checks)"
timeout ${COMPILE_TIMEOUT:-540} python3 benchmarks/compile_checks.py checks --json "$out/compile_checks.json" \
  >"$out/compile_checks.log" 2>&1
echo "compile checks exit $?"; grep -E "^(ok|FAIL)|checks passed" "$out/compile_checks.log"
grep -B2 -A30 "Traceback" "$out/compile_checks.log" | head -80
fi
if [[ $steps == *" fuzz "* ]]; then
wait
grep -hE "cases:|seed " "$out"/fuzz/*.log | grep -v "^  [a-z_]* [a-z]*: [0-9]* cases" | head -60
python3 - "$out/fuzz" <<'PY'
import collections, glob, json, sys
done = collections.defaultdict(lambda: [0, 0])  # (op, entry): cases done (a shard stopped by its timeout: to its last 200), failures
for path in glob.glob(f"{sys.argv[1]}/*.json"):
    for r in json.load(open(path))["results"]:
        done[r["op"], r["entry"]][0] += r["cases"]
        done[r["op"], r["entry"]][1] += r["failed"]
for (op, entry), (cases, failed) in sorted(done.items()):
    print(f"fuzz total {op} {entry}: {cases} cases, {failed} failed")
PY
tar czf "$out/fuzz.tgz" -C "$out" fuzz && rm -r "$out/fuzz"
fi
if [[ $steps == *" host_layer "* ]]; then
echo "== host time per decoder layer (benchmarks/host_per_layer.py)"
timeout ${HOST_LAYER_TIMEOUT:-120} python3 benchmarks/host_per_layer.py ${HOST_LAYER_ARGS:-} \
  --json "$out/host_per_layer.json" 2>&1 | grep -v Warning | tail -8
fi
if [[ $steps == *" compile_timings "* ]]; then
echo "== eager / compiled / CUDA-graph sides (benchmarks/compile_checks.py timings)"
timeout ${TIMINGS_TIMEOUT:-560} python3 benchmarks/compile_checks.py timings ${TIMINGS_ARGS:-} \
  --json "$out/compile_timings.json" 2>&1 | tee "$out/compile_timings.log" | tail -30
fi
