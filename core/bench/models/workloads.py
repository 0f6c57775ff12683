"""The catalogue of model workloads (:data:`WORKLOADS`) and :func:`select`."""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Sequence

from . import decoders
from ._common import ModelWorkload
from .decoders import LLAMA, MIXTRAL, QWEN2, RUNS_FULL, SEEN_LENGTHS, VARLEN_WARMUP, Family
from .sd15 import build_sd15_forward, build_sd15_train
from .unet import build_unet_backward, build_unet_forward


def _family_workloads(family: Family, first: str) -> tuple[ModelWorkload, ...]:
    """The prefill, varlen prefill, training and decode workloads of one family (``first`` describes the model)."""
    runs = RUNS_FULL
    title = f"the same {family.prefix} decoder"
    batch, seq = runs["prefill"]
    low, high = runs["varlen"]
    train_batch, train_seq = runs["train"]
    long_decode = family is QWEN2
    out = [
        ModelWorkload(f"{family.name}_prefill_512", f"{first}: model(input_ids), batch {batch} x {seq} tokens",
                      functools.partial(decoders.build_prefill, family), needs_transformers=True,
                      estimate_s=20 if long_decode else 17),
        ModelWorkload(f"{family.name}_prefill_varlen", f"{title}: model(input_ids), batch {runs['varlen_batch']}, "
                      f"a new prompt length ({low}-{high}, a seeded permutation) every call, after "
                      f"{VARLEN_WARMUP} such calls per side",
                      functools.partial(decoders.build_prefill_varlen, family), needs_transformers=True,
                      warmup=VARLEN_WARMUP, estimate_s=25 if long_decode else 18),
        ModelWorkload(f"{family.name}_prefill_varlen_seen", f"{title}: the varlen prefill's walk cut to "
                      f"{SEEN_LENGTHS} lengths served round and round, each twice in the warm-up (its steady state)",
                      functools.partial(decoders.build_prefill_varlen, family, seen=SEEN_LENGTHS),
                      needs_transformers=True, warmup=2 * SEEN_LENGTHS, estimate_s=25 if long_decode else 18),
        ModelWorkload(f"{family.name}_train", f"{title}: train mode, model(ids, labels=ids).loss.backward(), "
                      f"batch {train_batch} x {train_seq}, grads zeroed each step",
                      functools.partial(decoders.build_train, family), needs_transformers=True,
                      estimate_s=22 if long_decode else 17),
    ]
    for size in (1, 8):
        for cache in ("static", "dynamic"):
            out.append(ModelWorkload(
                f"{family.name}_decode_b{size}_{cache}",
                f"{title}: greedy {runs['new_tokens']} tokens after a {runs['prompt']}-token prompt, batch {size}, "
                f"{'StaticCache' if cache == 'static' else 'DynamicCache'}, explicit model(...) loop",
                functools.partial(decoders.build_decode, family, size, cache), needs_transformers=True, rounds=8,
                warmup=1, estimate_s=45 if long_decode else 10))
    return tuple(out)


LLAMA_TITLE = "Llama decoder (4 layers, hidden 1024, GQA 16/4 heads, vocab 32000, bf16)"
QWEN2_TITLE = ("Qwen2-0.5B-shaped decoder (24 layers, hidden 896, intermediate 4864, GQA 14/2 heads, "
               "vocab 151936, tied embeddings, bf16)")
MIXTRAL_TITLE = ("Mixtral-shaped MoE decoder (4 layers, hidden 1024, 8 experts of intermediate 1792, top 2, "
                 "GQA 16/4 heads, vocab 32000, bf16)")
#: The Mixtral workloads: a prefill and a batch-1 decode (the patch by form, beside the families named).
MIXTRAL_WORKLOADS = ("mixtral_prefill_512", "mixtral_decode_b1_dynamic")

WORKLOADS: tuple[ModelWorkload, ...] = (
    ModelWorkload("llama_prefill", f"{LLAMA_TITLE}: model(input_ids), batch 4 x 256 tokens",
                  decoders.build_llama_prefill, needs_transformers=True, estimate_s=17),
    ModelWorkload("llama_decode", "the same decoder: greedy 24 new tokens after a 128-token prompt, batch 4, "
                  "StaticCache, explicit model(...) loop", decoders.build_llama_decode, needs_transformers=True,
                  estimate_s=13),
    ModelWorkload("llama_generate", "the same decoder: model.generate(max_new_tokens=24, do_sample=False, "
                  "cache_implementation='static'), batch 4 x 128-token prompt", decoders.build_llama_generate,
                  needs_transformers=True, estimate_s=15),
    ModelWorkload("llama_generate_dynamic", "the same decoder: model.generate(max_new_tokens=24, do_sample=False) "
                  "with the default DynamicCache, batch 4 x 128-token prompt",
                  functools.partial(decoders.build_llama_generate, static=False), needs_transformers=True,
                  estimate_s=15),
    *_family_workloads(LLAMA, "the same Llama decoder"),
    *_family_workloads(QWEN2, QWEN2_TITLE),
    *(w for w in _family_workloads(MIXTRAL, MIXTRAL_TITLE) if w.name in MIXTRAL_WORKLOADS),
    ModelWorkload("unet_fwd_fp16", "4 x (Conv2d(320,320,3) -> GroupNorm(32,320) -> SiLU), 2x320x64x64 "
                  "channels_last, fp16 forward, no grad", build_unet_forward, estimate_s=7),
    ModelWorkload("unet_fwd_bwd_fp32", "the same stack in fp32: forward + backward of out.square().mean(), "
                  "grads zeroed each step", build_unet_backward, estimate_s=7),
    ModelWorkload("sd15_unet_fwd_fp16", "diffusers UNet2DConditionModel, SD-1.5 configuration (random weights): "
                  "model(latents, t, text states), 2x4x64x64 channels_last, text 2x77x768, fp16, no grad "
                  "[needs diffusers]", build_sd15_forward, estimate_s=20),
    ModelWorkload("sd15_unet_train_fp32", "the same UNet in fp32, train mode: forward + backward of "
                  "out.square().mean(), 1x4x32x32 channels_last, text 1x77x768, grads zeroed each step "
                  "[needs diffusers]", build_sd15_train, estimate_s=30),
)


def select(patterns: Sequence[str]) -> list[ModelWorkload]:
    """The workloads whose name equals, or matches as a glob, one of ``patterns`` (all when empty)."""
    if not patterns:
        return list(WORKLOADS)
    return [w for w in WORKLOADS if any(w.name == p or fnmatch.fnmatchcase(w.name, p) for p in patterns)]
