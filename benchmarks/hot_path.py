"""Measure what flaggems adds per routed call, and the cost of ``import flaggems``.

The implementation is trivial on purpose (it calls the captured native kernel),
so the difference between "registered directly with torch.library" and
"routed through flaggems" is the core's own per-call cost. The implementation
is not replayable, so with the compiled entry (``flaggems_us``) this is the
cost of its Python path (C++ key and look-up, then the Python entry); the
Python entry alone is ``python_entry_us``. What a replayed call costs against
torch is measured by ``benchmarks/small_calls.py``:

    python benchmarks/hot_path.py [--calls 200000] [--device cuda]

Prints a table; ``--json PATH`` also writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable


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
    parser.add_argument("--calls", type=int, default=30_000)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import torch

    import flaggems
    from flaggems import OpImpl, compiled, hookimpl
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

    class Trivial:
        @hookimpl
        def flaggems_operators(self):
            return [OpImpl("neg", trivial_neg)]

    class TrivialWithSupports:
        @hookimpl
        def flaggems_operators(self):
            return [OpImpl("neg", trivial_neg, supports=lambda t: True)]

    def direct() -> float:
        lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lib.impl("neg", trivial_neg, key)
        try:
            return per_call_us(lambda: torch.neg(x), args.calls, repeats=1)
        finally:
            lib._destroy()

    def routed(plugin, entry: str = "auto") -> Callable[[], float]:
        def measure() -> float:
            os.environ["FLAGGEMS_ENTRY"] = entry
            compiled.reset()
            RUNTIME.manager.register(plugin, "hot-path")
            try:
                with flaggems.enabled(include=["neg"]):
                    return per_call_us(lambda: torch.neg(x), args.calls, repeats=1)
            finally:
                RUNTIME.manager.unregister("hot-path")
        return measure

    # The host's speed drifts (up to 1.8x between H200 machines, and within a
    # run): the four sides are measured in interleaved rounds, medians compared.
    sides = {"native_us": lambda: per_call_us(lambda: torch.neg(x), args.calls, repeats=1),
             "direct_library_us": direct, "flaggems_us": routed(Trivial()),
             "flaggems_supports_us": routed(TrivialWithSupports()),
             "python_entry_us": routed(Trivial(), "python"),
             "python_entry_supports_us": routed(TrivialWithSupports(), "python")}
    samples: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, measure in sides.items():
            samples[name].append(measure())
    results.update({name: statistics.median(values) for name, values in samples.items()})
    results["overhead_us"] = results["flaggems_us"] - results["direct_library_us"]
    results["overhead_supports_us"] = results["flaggems_supports_us"] - results["direct_library_us"]
    results["python_entry_overhead_us"] = results["python_entry_us"] - results["direct_library_us"]
    results["python_entry_overhead_supports_us"] = (results["python_entry_supports_us"]
                                                    - results["direct_library_us"])
    os.environ["FLAGGEMS_ENTRY"] = "auto"
    compiled.reset()
    results["entry"] = flaggems.info()["entry"]
    results["rounds"] = args.rounds
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
