"""Run 12e: rank field width (10 vs 16 bits), with the new count warps and programs."""
import os, sys, time
exec(open(os.path.join(os.path.dirname(__file__), "run12b.py")).read().split("t0 = time.time()")[0])
t0 = time.time()
f16, f32 = torch.float16, torch.float32
for fb in (16, 10, 16, 10):
    configure(FIELD_BITS=fb)
    breakdown(f"fields{fb} fp16 b3", BIG, f16, 3)
    breakdown(f"fields{fb} fp32 b4", BIG, f32, 4)
configure(FIELD_BITS=16)
for fb in (16, 10):
    configure(FIELD_BITS=fb)
    for dtype, bits in ((f16, 3), (f32, 4), (torch.uint8, 3)):
        compare(f"total fields{fb} {str(dtype)[6:]}", BIG, dtype, bits)
configure(FIELD_BITS=16)
log("elapsed", time.time() - t0)
