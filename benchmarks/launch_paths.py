# ruff: noqa: E501, E702 - the C++ probe source is kept on one line per loop, as it is read
"""Host ns per launch of one Triton kernel through several submission paths, one process, interleaved."""
import json
import os
import statistics
import time

import torch
import triton
import triton.language as tl
from torch.utils.cpp_extension import load_inline

SRC = r'''
#include <torch/extension.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <dlfcn.h>
#include <chrono>
typedef int (*LK)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*, void**, void**);
typedef int (*RLK)(const void*, unsigned long long, unsigned long long, void**, size_t, void*);  // dim3 passed as 2x(x,y) packed? see below
typedef int (*LibLoad)(void**, const void*, void*, void*, unsigned, void*, void*, unsigned);
typedef int (*LibGetKernel)(void**, void*, const char*);
typedef int (*Memcpy)(unsigned long long, unsigned long long, size_t, void*);
typedef int (*GetErr)(int, const char**);
static void* cuda() { static void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL); return h; }
static void* cudart() {
  static void* h = nullptr;
  if (!h) { const char* names[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so"};
    for (auto n : names) { h = dlopen(n, RTLD_NOW | RTLD_NOLOAD); if (h) break; }
    if (!h) for (auto n : names) { h = dlopen(n, RTLD_NOW); if (h) break; } }
  return h; }
static void* stream_of(const at::Tensor& t) {
  c10::impl::VirtualGuardImpl impl(t.device().type());
  return impl.getStream(t.device()).native_handle(); }
static double now() { return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

double cu_launch(int64_t func, std::vector<at::Tensor> ptrs, std::vector<int64_t> ints, int64_t grid, int64_t block,
                 int64_t n) {
  auto f = (LK)dlsym(cuda(), "cuLaunchKernel");
  int64_t storage[64]; void* p[64]; size_t k = 0;
  for (auto& t : ptrs) { storage[k] = (int64_t)t.data_ptr(); p[k] = &storage[k]; ++k; }
  for (auto v : ints) { storage[k] = v; p[k] = &storage[k]; ++k; }
  void* s = stream_of(ptrs[0]);
  double t0 = now();
  for (int64_t i = 0; i < n; ++i) { int r = f((void*)func, grid, 1, 1, block, 1, 1, 0, s, p, nullptr); TORCH_CHECK(r == 0, "launch ", r); }
  return (now() - t0) / n; }

// the same, the stream fetched and the params rebuilt each call (what an entry does)
double cu_launch_full(int64_t func, std::vector<at::Tensor> ptrs, std::vector<int64_t> ints, int64_t grid, int64_t block,
                 int64_t n) {
  auto f = (LK)dlsym(cuda(), "cuLaunchKernel");
  double t0 = now();
  for (int64_t i = 0; i < n; ++i) {
    int64_t storage[64]; void* p[64]; size_t k = 0;
    for (auto& t : ptrs) { storage[k] = (int64_t)t.data_ptr(); p[k] = &storage[k]; ++k; }
    for (auto v : ints) { storage[k] = v; p[k] = &storage[k]; ++k; }
    void* s = stream_of(ptrs[0]);
    int r = f((void*)func, grid, 1, 1, block, 1, 1, 0, s, p, nullptr); TORCH_CHECK(r == 0, "launch ", r); }
  return (now() - t0) / n; }

// cubin -> CUlibrary -> CUkernel; launched through cuLaunchKernel (CUkernel as CUfunction) or cudaLaunchKernel
int64_t lib_kernel(std::string cubin, std::string name) {
  auto load = (LibLoad)dlsym(cuda(), "cuLibraryLoadData");
  auto get = (LibGetKernel)dlsym(cuda(), "cuLibraryGetKernel");
  TORCH_CHECK(load && get, "no cuLibrary API");
  void* lib = nullptr; int r = load(&lib, cubin.data(), nullptr, nullptr, 0, nullptr, nullptr, 0);
  TORCH_CHECK(r == 0, "cuLibraryLoadData ", r);
  void* k = nullptr; r = get(&k, lib, name.c_str()); TORCH_CHECK(r == 0, "cuLibraryGetKernel ", r);
  return (int64_t)k; }

struct Dim3 { unsigned x, y, z; };
typedef int (*RLK2)(const void*, Dim3, Dim3, void**, size_t, void*);
double rt_launch(int64_t func, std::vector<at::Tensor> ptrs, std::vector<int64_t> ints, int64_t grid, int64_t block,
                 int64_t n) {
  auto f = (RLK2)dlsym(cudart(), "cudaLaunchKernel");
  TORCH_CHECK(f, "no cudaLaunchKernel");
  int64_t storage[64]; void* p[64]; size_t k = 0;
  for (auto& t : ptrs) { storage[k] = (int64_t)t.data_ptr(); p[k] = &storage[k]; ++k; }
  for (auto v : ints) { storage[k] = v; p[k] = &storage[k]; ++k; }
  void* s = stream_of(ptrs[0]);
  Dim3 g{(unsigned)grid, 1, 1}, b{(unsigned)block, 1, 1};
  double t0 = now();
  for (int64_t i = 0; i < n; ++i) { int r = f((const void*)func, g, b, p, 0, s); TORCH_CHECK(r == 0, "cudaLaunchKernel ", r); }
  return (now() - t0) / n; }

double memcpy_loop(at::Tensor dst, at::Tensor src, int64_t n) {
  auto f = (Memcpy)dlsym(cuda(), "cuMemcpyDtoDAsync_v2");
  void* s = stream_of(dst);
  double t0 = now();
  for (int64_t i = 0; i < n; ++i) { int r = f((unsigned long long)dst.data_ptr(), (unsigned long long)src.data_ptr(), dst.nbytes(), s); TORCH_CHECK(r == 0); }
  return (now() - t0) / n; }

typedef int (*RMemcpy)(void*, const void*, size_t, int, void*);
double rt_memcpy_loop(at::Tensor dst, at::Tensor src, int64_t n) {
  auto f = (RMemcpy)dlsym(cudart(), "cudaMemcpyAsync");
  void* s = stream_of(dst);
  double t0 = now();
  for (int64_t i = 0; i < n; ++i) { int r = f(dst.data_ptr(), src.data_ptr(), dst.nbytes(), 3, s); TORCH_CHECK(r == 0); }
  return (now() - t0) / n; }

double torch_copy_loop(at::Tensor dst, at::Tensor src, int64_t n) {
  double t0 = now();
  for (int64_t i = 0; i < n; ++i) dst.copy_(src);
  return (now() - t0) / n; }
double torch_to_loop(at::Tensor src, int64_t n) {
  double t0 = now();
  for (int64_t i = 0; i < n; ++i) { auto o = src.to(at::kFloat); }
  return (now() - t0) / n; }
double torch_neg_loop(at::Tensor src, int64_t n) {
  double t0 = now();
  for (int64_t i = 0; i < n; ++i) { auto o = src.neg(); }
  return (now() - t0) / n; }
double torch_index_copy_loop(at::Tensor dst, at::Tensor index, at::Tensor src, int64_t n) {
  double t0 = now();
  for (int64_t i = 0; i < n; ++i) dst.index_copy_(0, index, src);
  return (now() - t0) / n; }
double empty_loop(at::Tensor like, int64_t n) {
  double t0 = now();
  for (int64_t i = 0; i < n; ++i) { auto o = at::empty_like(like); }
  return (now() - t0) / n; }
'''
FUNCS = ["cu_launch", "cu_launch_full", "lib_kernel", "rt_launch", "memcpy_loop", "rt_memcpy_loop", "torch_copy_loop",
         "torch_to_loop", "torch_neg_loop", "torch_index_copy_loop", "empty_loop"]


@triton.jit
def copy_kernel(dst, src, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)


@triton.jit
def empty_kernel(dst):
    pass


def main():
    ext = load_inline("launch_paths", SRC, functions=FUNCS, extra_ldflags=["-ldl"], verbose=False)
    dev = "cuda"
    src = torch.randn(4096, device=dev)
    dst = torch.empty_like(src)
    bf = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)
    ck = copy_kernel[(4,)](dst, src, 4096, BLOCK=1024)
    ek = empty_kernel[(1,)](dst)
    torch.cuda.synchronize()
    out = {"torch": torch.__version__, "triton": triton.__version__, "device": torch.cuda.get_device_name()}
    # triton 3.6 appends global_scratch and profile_scratch pointers
    def nparams(k):
        return k.metadata.num_warps * 32
    extra = [0, 0]
    block = ck.metadata.num_warps * 32
    fn = ck.function
    lib_ck = ext.lib_kernel(ck.asm["cubin"], ck.name)
    lib_ek = ext.lib_kernel(ek.asm["cubin"], ek.name)
    side = torch.cuda.Stream()
    paths = {
        "cuLaunchKernel copy (stream 0)": lambda n: ext.cu_launch(fn, [dst, src], [4096] + extra, 4, block, n),
        "cuLaunchKernel copy, params+stream per call": lambda n: ext.cu_launch_full(fn, [dst, src], [4096] + extra, 4, block, n),
        "cuLaunchKernel empty": lambda n: ext.cu_launch(ek.function, [dst], extra, 1, ek.metadata.num_warps * 32, n),
        "cuLaunchKernel CUkernel copy": lambda n: ext.cu_launch(lib_ck, [dst, src], [4096] + extra, 4, block, n),
        "cudaLaunchKernel CUkernel copy": lambda n: ext.rt_launch(lib_ck, [dst, src], [4096] + extra, 4, block, n),
        "cudaLaunchKernel CUkernel empty": lambda n: ext.rt_launch(lib_ek, [dst], extra, 1, ek.metadata.num_warps * 32, n),
        "cuMemcpyDtoDAsync 16KB": lambda n: ext.memcpy_loop(dst, src, n),
        "cudaMemcpyAsync 16KB": lambda n: ext.rt_memcpy_loop(dst, src, n),
        "at::copy_ C++ loop": lambda n: ext.torch_copy_loop(dst, src, n),
        "at::to(float) bf16 C++ loop": lambda n: ext.torch_to_loop(bf, n),
        "at::neg C++ loop": lambda n: ext.torch_neg_loop(src, n),
        "at::empty_like C++ loop": lambda n: ext.empty_loop(src, n),
    }
    def py_loop(f, n):
        t = time.perf_counter()
        for _ in range(n):
            f()
        return (time.perf_counter() - t) / n * 1e9
    paths["python dst.copy_(src) torch"] = lambda n: py_loop(lambda: dst.copy_(src), n)
    table = torch.randn(64, 64, device=dev)
    rows = torch.randn(64, 64, device=dev)
    order = torch.randperm(64, device=dev)
    paths["python bf16.to(float) torch"] = lambda n: py_loop(lambda: bf.to(torch.float32), n)
    paths["python index_copy_ [64,64] torch"] = lambda n: py_loop(lambda: table.index_copy_(0, order, rows), n)
    paths["at::index_copy_ [64,64] C++ loop"] = lambda n: ext.torch_index_copy_loop(table, order, rows, n)
    # the same C++ and Python loops with flaggems enabled (the dispatcher serves them from flaggems' entry)
    for name in list(paths):
        if name.startswith(("python", "at::copy_ C++", "at::to(float)", "at::index_copy_")):
            paths[name.replace(" torch", "") + " flaggems"] = paths[name]
    import flaggems
    from flaggems import compiled
    from flaggems.runtime import RUNTIME
    results = {k: [] for k in paths}
    for _rnd in range(7):
        for name, fn_ in paths.items():
            if "flaggems" in name:
                flaggems.enable()
            fn_(200)
            torch.cuda.synchronize()
            ns = fn_(3000)
            torch.cuda.synchronize()
            if "flaggems" in name:
                flaggems.disable()
            results[name].append(ns)
    phases = {}
    for name in [k for k in paths if k.endswith("flaggems")]:
        flaggems.enable()  # a fresh registry: its phase clocks start at zero
        module = compiled.loaded()
        if module is not None:
            paths[name](200)
            module.set_profiling(True)
            paths[name](3000)
            torch.cuda.synchronize()
            module.set_profiling(False)
            phases[name] = {op: row["phases"] for op, row in RUNTIME.plan_stats().items() if "phases" in row}
        out["entry"] = flaggems.info()["entry"]
        flaggems.disable()
    out["phases"] = phases
    print(json.dumps(phases, indent=1))
    # side stream
    with torch.cuda.stream(side):
        results["cuLaunchKernel copy (side stream)"] = [ext.cu_launch(fn, [dst, src], [4096] + extra, 4, block, 3000) for _ in range(5)]
        results["at::copy_ C++ loop (side stream)"] = [ext.torch_copy_loop(dst, src, 3000) for _ in range(5)]
    torch.cuda.synchronize()
    out["ns_per_call_median"] = {k: statistics.median(v) for k, v in results.items()}
    out["ns_per_call_min"] = {k: min(v) for k, v in results.items()}
    for k, v in out["ns_per_call_median"].items():
        print(f"{k:50s} {v:8.0f} ns (min {out['ns_per_call_min'][k]:.0f})")
    dst2 = torch.empty_like(src); copy_kernel[(4,)](dst2, src, 4096, BLOCK=1024)
    torch.cuda.synchronize()
    print("copy correct", torch.equal(dst2, src))
    path = os.path.join(os.environ.get("OUT", "."), "launch_paths.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
