"""The kit never runs torch's CPU ``repeat_interleave`` kernel where it overruns its output (heap corruption).

torch's CPU kernel (ATen ``Repeat.cpp``, ``compute_cpu``) compares ``output_size`` with the sum of the
repeats, allocates the output, then checks each ``repeats[i] >= 0`` inside its parallel loop, row by
row, each row writing ``[cumsum[i] - repeats[i], cumsum[i])``. A negative repeat with an
``output_size`` equal to the sum (the kit's generated ``negative/right`` cases) makes rows write
outside the output before the negative row raises. The randomized kit crashed that way
(``free(): invalid next size (fast)`` on an H200 host, through the CPU copies of
``_cpu_error``; ``free(): invalid pointer`` on the CPU, with the generator of the time case #1190
of seed 0: ``repeats=[-1, 2], output_size=1``).

The crashing calls run in a child process, so that a regression fails a test rather than killing the run.
(Without the kit's fix the two tests below abort: ``free(): invalid pointer``, ``double free or corruption``;
a test asserting the crash itself would depend on undefined behaviour being caught.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from flaggems.testing import random_cases as kit

TENSOR, SELF_TENSOR = "repeat_interleave.Tensor", "repeat_interleave.self_Tensor"

#: Row 0 writes 2000 elements into an output of 1000 before row 1 raises, whatever the threads.
OVERRUN = "[2000, -1000]", 1000
#: The kit's case: row 1, on another thread, writes element -1 (with more than one thread).
BEFORE_START = "[-1, 2]", 1


def _child(body: str) -> subprocess.CompletedProcess:
    """Run ``body`` (with ``kit``, ``torch`` and ``_prep`` defined) in a fresh interpreter."""
    prelude = textwrap.dedent("""
        import torch
        from flaggems.testing import Case, random_cases as kit
        from flaggems.testing._layouts import Built

        def _prep(repeats, output_size):
            built = Built((torch.tensor(repeats),), {"output_size": output_size})
            return kit.Prepared(built, Case("negative/right", lambda d: None, tags=("device-assert",)),
                                "negative/right")
    """)
    env = {**os.environ, "MALLOC_CHECK_": "3"}
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(body)], capture_output=True, text=True,
                          timeout=300, env=env)


@pytest.mark.parametrize("case", [OVERRUN, BEFORE_START], ids=["past-end", "before-start"])
def test_native_side_raises_torch_error_without_overrunning(case):
    repeats, size = case
    done = _child(f"""
        for _ in range(200):
            outcome = kit.call_native({TENSOR!r}, _prep({repeats}, {size}), torch.device("cpu"))
            assert isinstance(outcome.error, RuntimeError), outcome
            assert "repeats can not be negative" in str(outcome.error), outcome.error
            big = [torch.empty(n) for n in range(1, 64)]  # allocations and frees around the corrupted chunk
            del big
        print("ok")
    """)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_cpu_error_of_a_gpu_run_does_not_overrun():
    """On a GPU, the native side of a device-assert case asks torch's CPU kernel for the error type."""
    repeats, size = OVERRUN
    done = _child(f"""
        for _ in range(200):
            outcome = kit._cpu_error({TENSOR!r}, (torch.tensor({repeats}),), {{"output_size": {size}}})
            assert isinstance(outcome.error, RuntimeError), outcome
            big = [torch.empty(n) for n in range(1, 64)]
            del big
        print("ok")
    """)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_overrun_detection():
    neg = torch._neg_view(torch.tensor([1, -2]))  # reads as [-1, 2]: torch resolves it before its kernel
    assert kit.torch_cpu_overruns(TENSOR, (torch.tensor([-1, 2]),), {"output_size": 1})
    assert kit.torch_cpu_overruns(TENSOR, (neg,), {"output_size": 1})
    assert kit.torch_cpu_overruns(TENSOR, (torch.tensor([3, -1], dtype=torch.int32),), {"output_size": 2})
    assert kit.torch_cpu_overruns(SELF_TENSOR, (torch.arange(3), torch.tensor([-1])), {"output_size": -3})
    assert kit.torch_cpu_overruns(SELF_TENSOR, (torch.arange(2),), {"repeats": torch.tensor([2, -1]),
                                                                    "output_size": 1})
    assert not kit.torch_cpu_overruns(TENSOR, (torch.tensor([-1, 2]),), {})  # torch checks before writing
    assert not kit.torch_cpu_overruns(TENSOR, (torch.tensor([-1, 2]),), {"output_size": None})
    assert not kit.torch_cpu_overruns(TENSOR, (torch.tensor([1, 2]),), {"output_size": 3})
    assert not kit.torch_cpu_overruns(TENSOR, (torch.tensor([], dtype=torch.int64),), {"output_size": 0})
    assert not kit.torch_cpu_overruns("repeat_interleave.self_int", (torch.arange(2), -1), {"output_size": -2})
    assert not kit.torch_cpu_overruns("index_select", (torch.arange(2), 0, torch.tensor([-1])), {"output_size": 1})


def test_safe_kwargs_keep_everything_else():
    kwargs = {"dim": 0, "output_size": 1}
    args = (torch.arange(2), torch.tensor([-1, 2]))
    assert kit.cpu_safe_kwargs(SELF_TENSOR, args, kwargs) == {"dim": 0}
    assert kwargs == {"dim": 0, "output_size": 1}  # the case's own kwargs are left alone
    valid = {"output_size": 3}
    assert kit.cpu_safe_kwargs(TENSOR, (torch.tensor([1, 2]),), valid) is valid


@pytest.mark.skipif(kit.device().type != "cpu", reason="the kit's CPU run (Triton's interpreter)")
def test_generated_negative_cases_pass():
    """The kit's generated ``negative/right`` cases (a -1 among the repeats, ``output_size`` their sum):
    both sides raise torch's error, the native side without overrunning."""
    done = _child(f"""
        found = 0
        for draw in range(2000):
            rc = kit.RandomCase({TENSOR!r}, draw, kit.case_seed(0, {TENSOR!r}, draw), kit.GENERATED)
            prep = kit.build(rc, torch.device("cpu"), rc.seed)
            if prep.kind != "negative/right" or prep.built.args[0].dim() != 1 or prep.built.args[0].numel() < 2:
                continue
            assert kit.torch_cpu_overruns({TENSOR!r}, prep.built.args, prep.built.kwargs)
            target = next(t for t in kit.targets([{TENSOR!r}], "generic"))
            for _ in range(10):
                assert kit.check_direct(target, rc, torch.device("cpu")) == "passed"
            found += 1
            if found == 3:
                break
        assert found == 3, found
        print("ok")
    """)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
