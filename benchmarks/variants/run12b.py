"""Run 12b: breakdown, block sizes, element sizes, break-even sizes of the grouped scatter."""
import json, os, sys, time
import torch
from triton.testing import do_bench
from flaggems.binding import native_scope
from flaggems.toolkit import partition as mod

DEVICE = os.environ.get("DEV", "cuda")
BIG = int(os.environ.get("SIZE", 2**30))
out = {}
def log(k, v):
    out[k] = v; print(k, v, flush=True)
    json.dump(out, open(sys.argv[1], "w"), indent=1)
def bench(fn):
    return round(do_bench(fn, warmup=100, rep=500, return_mode="median"), 4)
def configure(**kw):
    for k, v in kw.items():
        setattr(mod, k, v)
    mod._LAUNCHERS.clear()
DEFAULT = dict(BLOCK=mod.BLOCK, PARTITION_WARPS=mod.PARTITION_WARPS, PARTITION_STAGES=mod.PARTITION_STAGES)

def make(size, dtype):
    g = torch.Generator(device=DEVICE).manual_seed(size)
    idx = torch.randperm(size, device=DEVICE, generator=g)[: size // 2]
    if dtype.is_floating_point:
        dest = torch.randn(size, device=DEVICE).to(dtype); src = torch.randn(size // 2, device=DEVICE).to(dtype)
    else:
        dest = torch.randint(-100, 100, (size,), device=DEVICE).to(dtype); src = torch.randint(-100, 100, (size // 2,), device=DEVICE).to(dtype)
    return dest, idx, src

def compare(name, size, dtype, bits=None, torch_too=True):
    dest, idx, src = make(size, dtype)
    rec = {}
    if torch_too:
        with native_scope():
            rec["torch"] = bench(lambda: dest.index_copy_(0, idx, src))
    d2 = dest.clone()
    st = mod.grouped_scatter(d2, idx, src, bits)
    with native_scope():
        dest.index_copy_(0, idx, src)
    rec["exact"] = bool(torch.equal(d2, dest)); rec["grouped"] = int(st[0]); rec["bits"] = bits or mod.digit_bits(d2)
    rec["grouped_ms"] = bench(lambda: mod.grouped_scatter(d2, idx, src, bits))
    if torch_too:
        rec["speedup"] = round(rec["torch"] / rec["grouped_ms"], 3)
    log(name, rec)
    del dest, d2, idx, src; torch.cuda.empty_cache()

def breakdown(name, size, dtype, bits):
    dest, idx, src = make(size, dtype); n = idx.numel()
    shift = mod.region_shift(size, bits)
    state = torch.ones(1, dtype=torch.int32, device=DEVICE)
    counts = torch.empty((1 << bits) * -(-n // mod.BLOCK) + 1, dtype=torch.int32, device=DEVICE)
    keys = [torch.empty(n, dtype=torch.int32, device=DEVICE) for _ in range(2)]
    vals = [torch.empty(n, dtype=dtype, device=DEVICE) for _ in range(2)]
    blocks = -(-n // mod.BLOCK); programs = (min(blocks, mod.PROGRAMS),)
    rec = {}
    for p, (i, s, sh) in enumerate(((idx, src, shift), (keys[0], vals[0], shift + bits))):
        rec[f"count{p+1}"] = bench(lambda: mod._launcher("count", bits)(programs, i, state, counts, n, 1, size, sh, blocks))
        slots = torch.cumsum(counts, 0, dtype=torch.int32)
        rec[f"cumsum{p+1}"] = bench(lambda: torch.cumsum(counts, 0, dtype=torch.int32))
        rec[f"partition{p+1}"] = bench(lambda: mod._launcher("partition", bits)(programs, i, s, state, slots, keys[p], vals[p], n, 1, 1, size, sh, blocks))
    rec["scatter"] = bench(lambda: mod._launcher("scatter")((-(-n // mod.SCATTER_BLOCK),), state, keys[1], vals[1], idx, src, dest, n, 1, 1, 1, size))
    rec["passes"] = round(sum(v for k, v in rec.items() if k != "scatter"), 3)
    log(name, rec)
    del dest, idx, src, keys, vals, counts; torch.cuda.empty_cache()

t0 = time.time()
f16, f32 = torch.float16, torch.float32
breakdown("breakdown fp16 b3", BIG, f16, 3)
breakdown("breakdown fp32 b4", BIG, f32, 4)
for block, warps in ((1024, 4), (1024, 8), (2048, 8), (512, 2), (512, 8)):
    configure(BLOCK=block, PARTITION_WARPS=warps)
    breakdown(f"breakdown fp16 b3 block{block} w{warps}", BIG, f16, 3)
    breakdown(f"breakdown fp32 b4 block{block} w{warps}", BIG, f32, 4)
configure(**DEFAULT)
log("elapsed_blocks", time.time() - t0)
for dtype, bits in ((torch.uint8, 3), (torch.bfloat16, 3), (f16, 3), (f32, 4), (torch.int32, 4), (torch.float64, 4), (torch.int64, 4), (torch.float64, None)):
    compare(f"[2^30] {str(dtype)[6:]} bits {bits}", BIG, dtype, bits)
log("elapsed_dtypes", time.time() - t0)
for size in (BIG >> 5, BIG >> 4, BIG >> 3, BIG >> 2, BIG >> 1):
    for dtype in (f16, f32):
        compare(f"size {size} {str(dtype)[6:]}", size, dtype)
log("elapsed", time.time() - t0)
