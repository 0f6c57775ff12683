"""Run 12d: programs, count warps, scatter warps/block for the grouped scatter."""
import os, sys, time
sys.argv += [] 
exec(open(os.path.join(os.path.dirname(__file__), "run12b.py")).read().split("t0 = time.time()")[0])
t0 = time.time()
f16, f32 = torch.float16, torch.float32
base = dict(PROGRAMS=mod.PROGRAMS, COUNT_WARPS=mod.COUNT_WARPS, SCATTER_WARPS=mod.SCATTER_WARPS, SCATTER_BLOCK=mod.SCATTER_BLOCK)
for label, kw in (("base", {}), ("programs2048", dict(PROGRAMS=2048)), ("programs4096", dict(PROGRAMS=4096)),
                  ("programs16384", dict(PROGRAMS=16384)), ("count_w4", dict(COUNT_WARPS=4)), ("count_w16", dict(COUNT_WARPS=16)),
                  ("scatter_w8", dict(SCATTER_WARPS=8)), ("scatter_w8_b2048", dict(SCATTER_WARPS=8, SCATTER_BLOCK=2048)),
                  ("scatter_w2_b512", dict(SCATTER_WARPS=2, SCATTER_BLOCK=512))):
    configure(**base); configure(**kw)
    breakdown(f"{label} fp16 b3", BIG, f16, 3)
    breakdown(f"{label} fp32 b4", BIG, f32, 4)
configure(**base)
log("elapsed", time.time() - t0)
