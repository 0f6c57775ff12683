"""flaggems under torch.distributed: a tensor-parallel Llama and an FSDP training step, against torch.

    torchrun --standalone --nproc-per-node 2 benchmarks/distributed.py [--device cuda|cpu] [--smoke]
                                                                        [--rounds N] [--json PATH]

Two processes (NCCL on GPUs, one per process; gloo on the CPU, where flaggems runs on the Triton
interpreter). Both parts build a ``LlamaForCausalLM`` from its config with random weights (seed 0, the
same on every rank; no download):

* **tensor parallel**: every decoder layer through ``torch.distributed.tensor.parallel`` (q/k/v and
  gate/up column-wise, o and down row-wise: each rank holds half the heads and half the MLP), bf16
  prefill of ``batch x seq`` tokens. The logits with flaggems enabled and the model patched
  (``flaggems.patch``) against the same sharded model without flaggems, then the time per forward of
  both, side by side in interleaved rounds.
* **FSDP**: two fp32 copies of the model, each layer and the root sharded with ``fully_shard``; one
  stays torch's, the other is patched and runs with flaggems enabled. Two SGD steps each: the losses
  and every parameter after them compared, then the time per training step of both, interleaved.

Rank 0 prints the results (and writes ``--json``); the exit status is 1 when an output differs beyond
its tolerance, or when flaggems served none of the fused calls. ``benchmarks/README.md`` and RESULTS.md
say where it ran.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import flaggems
from flaggems.bench.models import LLAMA, build_decoder

#: Model sizes: hidden and heads divisible by the two ranks (each holds half the heads and half the MLP).
FULL = {"layers": 8, "hidden": 2048, "intermediate": 5632, "heads": 16, "kv_heads": 4, "vocab": 32000,
        "batch": 4, "seq": 512, "train_batch": 2, "train_seq": 256}
SMOKE = {"layers": 2, "hidden": 64, "intermediate": 128, "heads": 4, "kv_heads": 2, "vocab": 256,
         "batch": 2, "seq": 8, "train_batch": 2, "train_seq": 8}
#: Largest difference allowed, relative to the reference's largest magnitude: bf16 logits, fp32 training.
BF16_TOLERANCE = 3e-2
FP32_TOLERANCE = 1e-4


def tensor_parallel_plan() -> dict[str, Any]:
    """Megatron-style sharding of one Llama decoder layer (the projections' module names)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    columns = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
    return {**{name: ColwiseParallel() for name in columns},
            "self_attn.o_proj": RowwiseParallel(), "mlp.down_proj": RowwiseParallel()}


def setup(device_type: str) -> tuple[torch.device, Any]:
    """The process group (NCCL on GPUs, gloo on the CPU), this rank's device and a 1-D device mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    if device_type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    return device, init_device_mesh(device_type, (dist.get_world_size(),))


def synchronize(device: torch.device) -> None:
    """Wait for this rank's device work and for the other ranks."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest absolute difference over the reference's largest magnitude."""
    actual, expected = actual.detach().float(), expected.detach().float()
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


def fused_replays() -> int | None:
    """Calls of flaggems' fused operators its compiled entry replayed so far (``None`` under the Python entry,
    which keeps no counters): above 0 shows flaggems served the patched model, not torch's references."""
    from flaggems.runtime import RUNTIME

    stats = RUNTIME.plan_stats()
    if not stats:
        return None
    return sum(row.get("replay", 0) + row.get("generic", 0) for key, row in stats.items()
               if key.startswith("flaggems::"))


def interleaved(sides: dict[str, tuple[Callable[[], None], Callable[[], Any]]], device: torch.device, rounds: int,
                steps: int) -> dict[str, float]:
    """Median milliseconds per step of each side, ``steps`` steps per side and round, sides alternating;
    each side is ``(prepare, step)``: ``prepare`` (untimed) sets the side up before its steps."""
    times: dict[str, list[float]] = {name: [] for name in sides}
    for prepare, step in sides.values():  # warm: compiles, plans
        prepare()
        step()
    for _ in range(rounds):
        for name, (prepare, step) in sides.items():
            prepare()
            synchronize(device)
            start = time.perf_counter()
            for _ in range(steps):
                step()
            synchronize(device)
            times[name].append((time.perf_counter() - start) * 1e3 / steps)
    return {name: statistics.median(values) for name, values in times.items()}


def tensor_parallel(device: torch.device, mesh: Any, p: dict[str, int], rounds: int) -> dict[str, Any]:
    """The sharded bf16 prefill: logits with flaggems against without, and the time per forward of each."""
    from torch.distributed.tensor.parallel import parallelize_module

    model = build_decoder(LLAMA, device, p)
    for layer in model.model.layers:
        parallelize_module(layer, mesh, tensor_parallel_plan())
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, p["vocab"], (p["batch"], p["seq"]), generator=generator).to(device)

    def forward() -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=ids).logits

    flaggems.disable()
    expected = forward()
    flaggems.enable()
    report = flaggems.patch(model)
    actual = forward()
    error, served = relative(actual, expected), fused_replays()

    def torch_side() -> None:
        flaggems.unpatch(model)
        flaggems.disable()

    def flaggems_side() -> None:
        flaggems.patch(model)
        flaggems.enable()

    times = interleaved({"torch": (torch_side, forward), "flaggems": (flaggems_side, forward)}, device, rounds, 3)
    torch_side()
    return {"error": error, "ok": error <= BF16_TOLERANCE and served != 0 and bool(report.patched),
            "patch": report.as_dict(), "fused_replays": served, "ms": times, "tokens": p["batch"] * p["seq"]}


def fsdp_model(device: torch.device, mesh: Any, p: dict[str, int],
               patched: bool) -> tuple[torch.nn.Module, Any, dict[str, Any] | None]:
    """An fp32 model, patched or not, each layer and the root sharded; its SGD optimizer; the patch report."""
    from torch.distributed.fsdp import fully_shard

    model = build_decoder(LLAMA, device, p).float().train()
    report = flaggems.patch(model).as_dict() if patched else None  # before fully_shard, which wraps them
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.SGD(model.parameters(), lr=1e-2), report


def fsdp(device: torch.device, mesh: Any, p: dict[str, int], rounds: int) -> dict[str, Any]:
    """Two SGD steps of torch's model and of the patched one with flaggems: losses, parameters, time."""
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(0, p["vocab"], (p["train_batch"], p["train_seq"] + 1), generator=generator).to(device)
    sides = {"torch": fsdp_model(device, mesh, p, False), "flaggems": fsdp_model(device, mesh, p, True)}

    def train_step(name: str) -> Callable[[], float]:
        model, optimizer, _ = sides[name]

        def step() -> float:
            logits = model(input_ids=ids[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.detach()

        return step

    switch = {"torch": flaggems.disable, "flaggems": flaggems.enable}
    steps = {name: (switch[name], train_step(name)) for name in sides}
    losses = {}
    for name, (prepare, step) in steps.items():
        prepare()
        losses[name] = [float(step()) for _ in range(2)]
    served = fused_replays()  # flaggems is enabled for the second side
    flaggems.disable()
    params = {name: [q.full_tensor() for q in sides[name][0].parameters()] for name in sides}
    param_error = max(relative(a, e) for a, e in zip(params["flaggems"], params["torch"]))
    loss_error = max(abs(a - e) / abs(e) for a, e in zip(losses["flaggems"], losses["torch"]))
    times = interleaved(steps, device, rounds, 2)
    flaggems.disable()
    return {"losses": losses, "loss_error": loss_error, "param_error": param_error,
            "ok": loss_error <= FP32_TOLERANCE and param_error <= FP32_TOLERANCE and served != 0
            and bool(sides["flaggems"][2]["patched"]), "ms": times, "patch": sides["flaggems"][2],
            "fused_replays": served}


def report(results: dict[str, Any]) -> str:
    """The lines rank 0 prints."""
    tp, sharded = results["tensor_parallel"], results["fsdp"]
    tp_ms, fs_ms = tp["ms"], sharded["ms"]
    return "\n".join([
        f"flaggems {flaggems.__version__}, torch {torch.__version__}, {results['world']} ranks on {results['device']}",
        f"tensor parallel: logits max relative difference {tp['error']:.2e} "
        f"({'ok' if tp['ok'] else 'DIFFERS'}, tolerance {BF16_TOLERANCE}); fused calls replayed by flaggems "
        f"{tp['fused_replays']}",
        f"tensor parallel: ms per forward torch {tp_ms['torch']:.3f} flaggems {tp_ms['flaggems']:.3f} "
        f"speedup {tp_ms['torch'] / tp_ms['flaggems']:.3f}x ({tp['tokens']} tokens); patched {tp['patch']['patched']}",
        f"fsdp: losses torch {sharded['losses']['torch']} flaggems {sharded['losses']['flaggems']}; "
        f"parameters after two steps {sharded['param_error']:.2e} ({'ok' if sharded['ok'] else 'DIFFERS'}, "
        f"tolerance {FP32_TOLERANCE}); fused calls replayed by flaggems {sharded['fused_replays']}",
        f"fsdp: ms per training step torch {fs_ms['torch']:.3f} flaggems {fs_ms['flaggems']:.3f} "
        f"speedup {fs_ms['torch'] / fs_ms['flaggems']:.3f}x; patched {sharded['patch']['patched']}",
    ])


def main(argv: list[str] | None = None) -> int:
    """Run both parts on every rank; rank 0 reports."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (the CPU test)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="write the results here (rank 0)")
    args = parser.parse_args(argv)
    device, mesh = setup(args.device)
    p = SMOKE if args.smoke or args.device == "cpu" else FULL
    try:
        results = {"world": dist.get_world_size(), "device": str(device), "sizes": p,
                   "torch": torch.__version__, "tensor_parallel": tensor_parallel(device, mesh, p, args.rounds),
                   "fsdp": fsdp(device, mesh, p, args.rounds)}
        if dist.get_rank() == 0:
            print(report(results), flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(results, f, indent=1)
        ok = results["tensor_parallel"]["ok"] and results["fsdp"]["ok"]
    finally:
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
