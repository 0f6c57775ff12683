"""Run the seed workloads through flaggems and check them against native torch.

On a machine without a GPU the kernels run in Triton's interpreter on CPU
tensors, so the shapes are small. For each workload the demo prints which
implementation actually ran (from the ``dispatch`` log channel) and whether
the result equals torch's.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from typing import Any

import torch

import flaggems


class _Recorder(logging.Handler):
    """Collects the dispatch log records of one workload."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def workloads(dev: torch.device) -> list[tuple[str, Callable[[], Any]]]:
    """The seed documents' operations, at demo sizes."""
    x = torch.randn(128, device=dev)
    mask = torch.randn(1, 1, 16, 16, device=dev).expand(2, 4, 16, 16)
    rows = torch.arange(17, device=dev)
    repeats = torch.full((17,), 3, device=dev, dtype=torch.long)
    base = torch.randn(8, 33, device=dev)
    source = torch.randn(8, 5, device=dev)
    index = torch.tensor([0, 7, 3, 31, 12], device=dev)
    images = torch.randn(2, 48, 5, 7, device=dev).to(memory_format=torch.channels_last)
    grad_images = torch.randn(2, 48, 5, 7, device=dev)
    return [
        ("copy_ from expand (seed 001)", lambda: torch.empty(4, 128, device=dev).copy_(x.expand(4, 128))),
        ("copy_ fp32 -> bf16 from expand", lambda: torch.empty(4, 128, device=dev, dtype=torch.bfloat16)
         .copy_(x.expand(4, 128))),
        ("SDPA mask fp32 -> bf16 (seed 001)", lambda: mask.to(torch.bfloat16)),
        ("_to_copy transposed -> fp16", lambda: base.t().to(torch.float16)),
        ("contiguous() of permuted", lambda: images.permute(0, 3, 1, 2).contiguous()),
        ("index_copy dim 1 (seed 000)", lambda: base.index_copy(1, index, source)),
        ("index_copy_ dim -1", lambda: base.clone().index_copy_(-1, index, source)),
        ("index_select dim 1", lambda: base.index_select(1, index)),
        ("repeat_interleave values, output_size (seed 002)",
         lambda: torch.repeat_interleave(rows, repeats, output_size=51)),
        ("repeat_interleave Tensor, output_size", lambda: torch.repeat_interleave(repeats, output_size=51)),
        ("repeat_interleave self_int bf16", lambda: base.to(torch.bfloat16).repeat_interleave(4, dim=0)),
        ("group_norm channels_last C=48 G=16 (seed 004)",
         lambda: torch.nn.functional.group_norm(images, 16)),
        ("group_norm backward channels_last (seed 004)", lambda: _group_norm_grad(images, grad_images)),
        ("unfold view + copy (Tensor.repeat, seed 004)", lambda: base.repeat(1, 2, 2)),
        *_fused(dev),
    ]


def _fused(dev: torch.device) -> list[tuple[str, Callable[[], Any]]]:
    """flaggems' own fused operators (``flaggems.ops``), and a patched decoder where transformers is installed."""
    hidden = torch.randn(2, 3, 64, device=dev, dtype=torch.bfloat16)
    residual = torch.randn(2, 3, 64, device=dev, dtype=torch.bfloat16)
    weight = torch.randn(64, device=dev, dtype=torch.bfloat16)
    q = torch.randn(2, 3, 4 * 16, device=dev).view(2, 3, 4, 16).transpose(1, 2)  # [B, heads, S, D] view
    k = torch.randn(2, 3, 2 * 16, device=dev).view(2, 3, 2, 16).transpose(1, 2)
    angles = torch.randn(2, 3, 16, device=dev)
    cache = torch.randn(2, 2, 5, 16, device=dev)  # keys (and values) of 5 positions: [B, kv heads, L, D]
    gate, up = torch.randn(2, 3, 96, device=dev), torch.randn(2, 3, 96, device=dev)
    blocks = torch.randn(2, 40, 5, 7, device=dev).to(memory_format=torch.channels_last)
    norm_weight, norm_bias = torch.randn(40, device=dev), torch.randn(40, device=dev)
    ops = torch.ops.flaggems
    rows = [
        ("flaggems::rms_norm bf16 (Llama's rounding)", lambda: ops.rms_norm(hidden, weight, 1e-6)),
        ("flaggems::add_rms_norm bf16", lambda: ops.add_rms_norm(hidden, residual, weight, 1e-6)[0]),
        ("flaggems::rotary_embedding q and k (GQA)", lambda: torch.cat([t.flatten() for t in ops.rotary_embedding(
            q, k, angles.cos(), angles.sin())])),
        ("flaggems::rotary_cache_append (decode step on a DynamicCache)", lambda: torch.cat([
            t.flatten() for t in ops.rotary_cache_append(q[:, :, :1], k[:, :, :1], k[:, :, 1:2], angles[:, :1].cos(),
                                                         angles[:, :1].sin(), cache, cache)])),
        ("flaggems::silu_mul", lambda: ops.silu_mul(gate, up)),
        ("flaggems::gelu_tanh_mul", lambda: ops.gelu_tanh_mul(gate, up)),
        ("flaggems::gelu_mul (exact GELU: diffusers' GEGLU)", lambda: ops.gelu_mul(gate, up)),
        ("flaggems::group_norm_silu channels_last G8 (UNet)",
         lambda: ops.group_norm_silu(blocks, 8, norm_weight, norm_bias)),
    ]
    try:
        import transformers
    except ImportError:
        return rows
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(dev).eval()
    flaggems.patch(model)
    ids = torch.randint(0, 64, (1, 6), device=dev)
    rows.append(("flaggems.patch(LlamaForCausalLM) logits", lambda: _logits(model, ids)))
    rows.append(("flaggems.patch(LlamaForCausalLM) generate (attention blocks fused on its DynamicCache)",
                 lambda: _greedy_logits(model, ids)))
    if hasattr(transformers, "Gemma2Config"):  # no table names Gemma 2: patched by the form of its modules
        config = transformers.Gemma2Config(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                           pad_token_id=None, bos_token_id=None, eos_token_id=None)
        gemma = transformers.Gemma2ForCausalLM(config).to(dev).eval()
        flaggems.patch(gemma)
        rows.append(("flaggems.patch(Gemma2ForCausalLM) logits (by form)", lambda: _logits(gemma, ids)))
    return rows


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def _greedy_logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """The scores of 4 greedy tokens: decode steps run the fused rotary + cache append."""
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4,
                             do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    return torch.stack(out.scores)


def _group_norm_grad(x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """The input's gradient through ``F.group_norm`` (forward and backward both routed)."""
    x = x.detach().requires_grad_()
    (grad,) = torch.autograd.grad(torch.nn.functional.group_norm(x, 16), x, dy)
    return grad


def _same(a: Any, b: Any) -> bool:
    if a.dtype == torch.bfloat16:  # two ulps: the interpreter truncates to bf16 where torch rounds, and a
        # computing kernel's sum of squares in another order flips an occasional last bit (rms_norm)
        return torch.allclose(a.float(), b.float(), rtol=2**-6, atol=2**-6)
    if a.dtype.is_floating_point and a.dtype != b.dtype:
        return False
    return a.dtype == b.dtype and a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def main(argv: list[str] | None = None) -> int:
    """Run the workloads (``--only``: those whose name contains a word given) natively and through flaggems.

    Returns the number of mismatches.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", default=[], metavar="WORD",
                        help="run only workloads whose name contains WORD (repeatable)")
    only = parser.parse_args(argv).only
    active = flaggems.backend()
    dev = torch.device(active.device_type)
    print(f"backend {active.name}{' (simulated)' if active.simulated else ''} on {dev}: {active.reason}\n")
    recorder = _Recorder()
    dispatch = logging.getLogger("flaggems.dispatch")
    dispatch.setLevel(logging.INFO)  # read by enable(): entries that log are built
    dispatch.propagate = False
    dispatch.addHandler(recorder)
    failures = 0
    for name, run in workloads(dev):
        if only and not any(word in name for word in only):
            continue
        torch.manual_seed(0)
        expected = run()
        recorder.lines.clear()
        with flaggems.enabled():
            torch.manual_seed(0)
            actual = run()
        # The interpreter's own internal copies show up as re-entered natives: not interesting here.
        ran = sorted({line for line in recorder.lines if "re-entered" not in line})
        ran = ran or ["native (no flaggems implementation routed)"]
        ok = _same(actual, expected)
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name:<48} {'; '.join(ran)}")
    print(f"\n{failures} mismatch(es)")
    return failures


if __name__ == "__main__":
    raise SystemExit(main())
