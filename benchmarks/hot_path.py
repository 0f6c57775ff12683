"""Measure what flaggems adds per routed call, and the cost of ``import flaggems``.

The implementation is trivial on purpose (it calls the captured native kernel),
so the difference between "registered directly with torch.library" and
"routed through flaggems" is the core's own per-call cost:

    python benchmarks/hot_path.py [--calls 200000] [--device cuda]

Prints a table; ``--json PATH`` also writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import warnings


def per_call_us(fn, calls: int, repeats: int = 7) -> float:
    """Median over ``repeats`` of the mean wall-clock time of ``calls`` calls (µs)."""
    for _ in range(min(calls, 2000)):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def import_time_s() -> float:
    """Seconds ``import flaggems`` adds on top of ``import torch, triton`` (fresh process, median of 5)."""
    code = ("import time, torch, triton; t = time.perf_counter(); import flaggems; "
            "print(time.perf_counter() - t)")
    runs = [float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                 check=True).stdout) for _ in range(5)]
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100_000)
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import torch

    import flaggems
    from flaggems import OpImpl, hookimpl
    from flaggems.binding import NativeKernel
    from flaggems.runtime import RUNTIME

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    key = "CUDA" if device == "cuda" else "CPU"
    x = torch.randn(4096, device=device)
    native = NativeKernel.capture("neg", key)
    kernel, keyset = native.kernel, native.keyset

    def trivial_neg(t):
        return kernel.call_boxed(keyset, t)

    results = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
               "torch": torch.__version__, "calls": args.calls}
    results["native_us"] = per_call_us(lambda: torch.neg(x), args.calls)

    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lib.impl("neg", trivial_neg, key)
    results["direct_library_us"] = per_call_us(lambda: torch.neg(x), args.calls)
    lib._destroy()

    class Trivial:
        @hookimpl
        def flaggems_operators(self):
            return [OpImpl("neg", trivial_neg)]

    class TrivialWithSupports:
        @hookimpl
        def flaggems_operators(self):
            return [OpImpl("neg", trivial_neg, supports=lambda t: True)]

    for label, plugin in (("flaggems_us", Trivial()), ("flaggems_supports_us", TrivialWithSupports())):
        RUNTIME.manager.register(plugin, "hot-path")
        with flaggems.enabled(include=["neg"]):
            results[label] = per_call_us(lambda: torch.neg(x), args.calls)
        RUNTIME.manager.unregister("hot-path")
    results["overhead_us"] = results["flaggems_us"] - results["direct_library_us"]
    results["overhead_supports_us"] = results["flaggems_supports_us"] - results["direct_library_us"]
    results["import_flaggems_s"] = import_time_s()

    width = max(map(len, results))
    for name, value in results.items():
        shown = f"{value:.3f}" if isinstance(value, float) else value
        print(f"{name:<{width}}  {shown}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
