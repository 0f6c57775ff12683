"""Run 12 experiments: grouped scatter variants on [2^30] (fp16, fp32), random and sorted."""
import importlib, json, sys, time
import torch, triton
from triton.testing import do_bench
import flaggems
from flaggems.binding import native_scope

out = {}
def log(k, v):
    out[k] = v; print(k, v, flush=True)
    json.dump(out, open(sys.argv[1], "w"), indent=1)

torch.manual_seed(0)
import os; SIZE = int(os.environ.get("SIZE", 2**30)); DEVICE = os.environ.get("DEV", "cuda")
N = SIZE // 2
idx_rand = torch.randperm(SIZE, device=DEVICE)[:N]
idx_sort = torch.arange(SIZE // 4, SIZE // 4 + N, device=DEVICE)

def bench(fn):
    return do_bench(fn, warmup=100, rep=600, return_mode="median")

head = importlib.import_module("flaggems.toolkit._partition_head")
new = importlib.import_module("flaggems.toolkit.partition")

def configure(mod, **kw):
    for k, v in kw.items():
        setattr(mod, k, v)
    if "DIGIT_BITS" in kw:
        mod.DIGITS = 1 << kw["DIGIT_BITS"]
    mod._LAUNCHERS.clear()

def run_variant(name, mod, dtype, kinds=("rand", "sort"), parts=True, **kw):
    configure(mod, **kw)
    dest = torch.randn(SIZE, device=DEVICE).to(dtype)
    src = torch.randn(N, device=DEVICE).to(dtype)
    for kind in kinds:
        idx = idx_rand if kind == "rand" else idx_sort
        d2 = dest.clone()
        st = mod.grouped_scatter(d2, idx, src)
        ref = dest.clone()
        with native_scope():
            ref.index_copy_(0, idx, src)
        ok = bool(torch.equal(d2, ref)); del ref
        ms = bench(lambda: mod.grouped_scatter(d2, idx, src))
        rec = {"ms": round(ms, 3), "exact": ok, "grouped": int(st[0])}
        if parts and kind == "rand":
            n = N; shift = mod.region_shift(SIZE)
            state = torch.ones(1, dtype=torch.int32, device=DEVICE)
            counts = torch.empty(mod.DIGITS * -(-n // mod.BLOCK) + 1, dtype=torch.int32, device=DEVICE)
            keys = [torch.empty(n, dtype=torch.int32, device=DEVICE) for _ in range(2)]
            vals = [torch.empty(n, dtype=dtype, device=DEVICE) for _ in range(2)]
            bits = getattr(mod, "DIGIT_BITS", 3)
            rec["passes_ms"] = round(bench(lambda: (mod._partition(idx, src, state, SIZE, shift, counts, keys[0], vals[0]),
                                                    mod._partition(keys[0], vals[0], state, SIZE, shift + bits, counts, keys[1], vals[1]))), 3)
            rec["scatter_ms"] = round(bench(lambda: mod._launcher("scatter")((-(-n // mod.SCATTER_BLOCK),), state, keys[1], vals[1], idx, src, d2, n, 1, 1, 1, SIZE)), 3)
            del counts, keys, vals
        log(f"{name} {str(dtype)[6:]} {kind}", rec)
        del d2
    del dest, src
    torch.cuda.empty_cache()

def torch_ref(dtype):
    dest = torch.randn(SIZE, device=DEVICE).to(dtype); src = torch.randn(N, device=DEVICE).to(dtype)
    with native_scope():
        for kind, idx in (("rand", idx_rand), ("sort", idx_sort)):
            log(f"torch {str(dtype)[6:]} {kind}", {"ms": round(bench(lambda: dest.index_copy_(0, idx, src)), 3)})
    del dest, src; torch.cuda.empty_cache()

t0 = time.time()
torch_ref(torch.float16)
run_variant("head", head, torch.float16)
run_variant("full_b512_w4_s2", new, torch.float16)
run_variant("full_b512_w4_s1", new, torch.float16, PARTITION_STAGES=1)
run_variant("full_b256_w2_s2", new, torch.float16, kinds=("rand",), BLOCK=256, PARTITION_WARPS=2, PARTITION_STAGES=2)
run_variant("full_b256_w4_s2", new, torch.float16, kinds=("rand",), BLOCK=256, PARTITION_WARPS=4, PARTITION_STAGES=2)
run_variant("full_b256_w1_s2", new, torch.float16, kinds=("rand",), BLOCK=256, PARTITION_WARPS=1, PARTITION_STAGES=2)
run_variant("full_b256_w2_s1", new, torch.float16, kinds=("rand",), BLOCK=256, PARTITION_WARPS=2, PARTITION_STAGES=1)
run_variant("full_b512_sc2048", new, torch.float16, kinds=("rand",), parts=False, BLOCK=512, PARTITION_WARPS=4, PARTITION_STAGES=2, SCATTER_BLOCK=2048)
run_variant("full_b512_sc512", new, torch.float16, kinds=("rand",), parts=False, SCATTER_BLOCK=512)
configure(new, SCATTER_BLOCK=1024)
log("elapsed_fp16", time.time() - t0)
# 4-bit digits: 256 regions (8 MiB fp16, 16 MiB fp32)
run_variant("full_b256_w2_s2_d4", new, torch.float16, kinds=("rand",), BLOCK=256, PARTITION_WARPS=2, DIGIT_BITS=4)
run_variant("full_b512_w4_s2_d4", new, torch.float16, kinds=("rand",), BLOCK=512, PARTITION_WARPS=4, DIGIT_BITS=4)
torch_ref(torch.float32)
run_variant("full_b256_w2_s2_d4", new, torch.float32, kinds=("rand",), BLOCK=256, PARTITION_WARPS=2, DIGIT_BITS=4)
run_variant("full_b512_w4_s2_d4", new, torch.float32, kinds=("rand",), BLOCK=512, PARTITION_WARPS=4, DIGIT_BITS=4)
run_variant("full_b512_w4_s2_d3", new, torch.float32, kinds=("rand",), BLOCK=512, PARTITION_WARPS=4, DIGIT_BITS=3)
log("elapsed", time.time() - t0)
