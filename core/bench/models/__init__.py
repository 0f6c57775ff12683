"""``flaggems bench --models``: real model code, torch eager against flaggems (and fused rivals), side by side.

A faster kernel that makes a model slower is a loss, so this times whole
model steps, in one process, on the same weights and inputs, on up to four
*sides*:

* ``torch``: eager torch, flaggems disabled (the reference);
* ``flaggems``: the same code with ``flaggems.enable()``;
* ``patched``: ``flaggems.enable()`` plus ``flaggems.patch(model)`` (fused
  RMSNorm, residual add + RMSNorm, SiLU-mul and rotary operators; undone with
  ``flaggems.unpatch`` when the side is left);
* ``liger``: Liger-Kernel (when ``liger_kernel`` is importable, on CUDA):
  ``apply_liger_kernel_to_llama`` / ``_qwen2`` with rope, rms_norm and swiglu
  on a deep copy of the model, flaggems disabled. Liger also rebinds names in
  transformers' modeling module (``apply_rotary_pos_emb``, ``LlamaRMSNorm``...)
  and, in older releases, class attributes: those are snapshotted before it is
  applied and swapped in only while the liger side runs, so no other side sees
  them. An API this benchmark does not know skips the side with one line.

``patched`` and ``liger`` need a transformers decoder (``patched`` also takes
the diffusers UNet); they are omitted for the UNet stack. ``--side`` picks
sides (torch always runs).

Workloads (bf16 decoders built from configs: random weights, nothing downloaded,
SDPA attention, eval mode except training) and what each takes on an H200 with
four sides (estimated from the Llama decode step of ~6 ms and Qwen2's 24 layers;
``--list`` prints them):

* ``llama_prefill``: Llama-style decoder (4 layers, hidden 1024, GQA 16/4,
  vocab 32000), ``model(input_ids)`` on 4 x 256 tokens (~10 s);
* ``llama_decode``: greedy 24 tokens after a 128-token prompt, batch 4, into a
  ``StaticCache`` (``index_copy_``), explicit ``model(...)`` loop: ms per
  generate, per prefill into the cache and per decode step (~15 s);
* ``llama_generate`` / ``llama_generate_dynamic``: ``model.generate`` with a
  static cache (its automatic ``torch.compile`` off) / the default
  ``DynamicCache`` (~15 s each);
* ``{llama,qwen2}_decode_b{1,8}_{static,dynamic}``: greedy 32 tokens after a
  128-token prompt, batch 1 or 8, ``StaticCache`` or ``DynamicCache`` (K/V grow
  every token), explicit loop; Qwen2 is the Qwen2-0.5B shape (24 layers, hidden
  896, 14/2 heads, vocab 151936, tied embeddings): ~10 s each for Llama, ~45 s
  each for Qwen2 (8 rounds, 1 warm-up step per side by default);
* ``{llama,qwen2}_prefill_512``: ``model(input_ids)`` on 4 x 512 tokens (~15 s);
* ``{llama,qwen2}_train``: train mode, ``model(ids, labels=ids).loss.backward()``
  on 4 x 256 tokens, grads zeroed each step (~15 s);
* ``{llama,qwen2}_prefill_varlen``: ``model(input_ids)`` on 2 prompts whose
  length is new at every call (a seeded permutation of 97-496: every side sees
  the same sequence), timed after 64 such calls per side, a server's steady
  state (~18 s); ``*_prefill_varlen_seen``: the same walk cut to 32 lengths
  served round and round (each twice before timing): its steady-state twin;
  both keep attention off cuDNN's SDPA (a plan built per new shape);
* ``mixtral_prefill_512`` / ``mixtral_decode_b1_dynamic``: the same two
  workloads on a Mixtral-shaped MoE decoder (4 layers, hidden 1024, 8 experts
  of 1792, top 2), a family ``flaggems.patch`` knows by form (~20 s each);
* ``unet_fwd_fp16`` / ``unet_fwd_bwd_fp32``: a UNet-style stack of Conv2d ->
  GroupNorm -> SiLU blocks on channels_last input (pure torch; torch and
  flaggems sides only, ~7 s each);
* ``sd15_unet_fwd_fp16`` / ``sd15_unet_train_fp32`` (need diffusers): diffusers'
  ``UNet2DConditionModel`` in the SD-1.5 configuration, built from its
  constructor (random weights, nothing downloaded), channels_last: the fp16
  forward of 2x4x64x64 latents with 2x77x768 text states, no grad (output
  within 3e-2 of torch's largest magnitude), and an fp32 training step on
  1x4x32x32 latents, forward + backward of ``out.square().mean()`` (output,
  loss and every gradient within 1e-4 in relative norm, 1e-3 with TF32
  convolutions); torch, flaggems and patched sides (``flaggems.patch`` fuses
  the ResnetBlock2D norms and SiLUs), ~20 s and ~30 s.

Everything: about 9 minutes with four sides (8 without the two ``sd15_*``);
``--only 'qwen2*'`` about 4.

Per workload and side: one untimed step whose output is checked against torch's
(with the ``flaggems.dispatch`` log channel on: what served each call), the
side's warm-up steps, one untimed *census* step (calls per step, below), then
``rounds`` rounds, the sides interleaved round by round with the order rotated
each round (each side takes each position equally often, so a drifting host
hits every side alike); a round is ``steps`` back-to-back steps between two
device synchronisations (by default as many as take about 200 ms on torch; a
step longer than that is timed alone), after one untimed step that follows
each change of side. Times are medians over rounds; each ratio
torch/side is the median of the rounds' pairs, with the lowest and highest.

Calls per step: the census step runs under a ``TorchDispatchMode`` that counts
every operator call reaching the dispatcher's Python key (aten ops after
autograd and composite decomposition, and ``flaggems::`` fused ops; calls made
inside a kernel are not seen), per metric phase; on CUDA it also runs under
``torch.profiler`` (CPU and CUDA activity) and counts the kernels the device
ran (memcpy/memset counted apart), binned per phase by markers at each phase
boundary. Both are outside the timed rounds.

Checks (per side, against torch's output of the same step): logits within
:data:`LOGITS_TOLERANCE` (the largest difference over the vocabulary, divided
by the largest torch logit of that row); greedy tokens equal, a row allowed to
part only at a step whose logits agree within that tolerance (a near-tie that
rounding flipped; later steps of that row are not compared); gradients within
:data:`GRAD_TOLERANCE` (norm of the difference over the norm of torch's, per
tensor), the loss within :data:`LOGITS_TOLERANCE` (relative). When a side misses those, it
still passes when it is no less accurate than torch: its error against an fp32
run of the same model (teacher-forced on torch's tokens) at most twice torch's
own bf16 error against it.

Usage::

    flaggems bench --models                          # everything, on a GPU
    flaggems bench --models --only 'qwen2*' --side patched --json models.json --plot models.png
    flaggems bench --models --smoke                  # tiny models; also on the CPU interpreter
    python benchmarks/models.py --steps 20 --rounds 15

Exit status: 0; 1 when a workload or a side raised or a side's output differs
from torch's; 2 for a usage problem or when every workload was skipped.
"""

from __future__ import annotations

import torch as torch
from torch import nn as nn

import flaggems as flaggems

from ...testing.steady import off_replay as off_replay
from .. import report as report
from .. import runner as runner
from ..report import plot_available as plot_available
from ..runner import FLAGGEMS as FLAGGEMS
from ..runner import TOLERANCES as TOLERANCES
from ..runner import TORCH as TORCH
from ..runner import Target as Target
from ._common import (
    ACCURACY_FACTOR,
    COMPILED,
    DEFAULT_SIDES,
    GRAD_TOLERANCE,
    LIGER,
    LOGITS_TOLERANCE,
    OFF,
    PATCHED,
    PATCHED_COMPILED,
    SIDE_NAMES,
    SIDES,
    SMOKE_BANNER,
    Case,
    Check,
    Metric,
    MetricResult,
    ModelApiError,
    ModelResult,
    ModelSlot,
    ModelWorkload,
    Phases,
    Settings,
    SideResult,
    Skip,
    describe_exception,
)
from ._deps import LIGER_FUNCTIONS, LIGER_OPTIONS, liger_apply, liger_unavailable, transformers_available
from .calls import MARKER, CallCounter, Census, CountingPhases, call_activity, census, device_activity, is_op
from .calls import _outermost as _outermost
from .calls import _phase as _phase
from .calls import _profiled_census as _profiled_census
from .checks import (
    Exact,
    both,
    close,
    decode_check,
    detached_copy,
    grads_check,
    logits_check,
    prefill_check,
    row_errors,
    tensors_of,
    tokens_equal,
)
from .checks import _against_exact as _against_exact
from .checks import _as_accurate as _as_accurate
from .checks import _judged_against as _judged_against
from .checks import _relative_norm as _relative_norm
from .checks import _tensor_close as _tensor_close
from .cli import _misplaced_options as _misplaced_options
from .cli import _print_partial as _print_partial
from .cli import _run as _run
from .cli import _usage as _usage
from .cli import build_parser, cmd_models, main
from .decoders import (
    DECODE_METRICS,
    LLAMA,
    LLAMA_DTYPE,
    LLAMA_FULL,
    LLAMA_SMOKE,
    MIXTRAL,
    MIXTRAL_FULL,
    MIXTRAL_SMOKE,
    QWEN2,
    QWEN2_FULL,
    QWEN2_SMOKE,
    RUNS_FULL,
    RUNS_SMOKE,
    SEEN_LENGTHS,
    VARLEN_SDPA,
    VARLEN_WARMUP,
    Family,
    GreedyDecoder,
    LlamaApi,
    build_decode,
    build_decoder,
    build_llama,
    build_llama_decode,
    build_llama_generate,
    build_llama_prefill,
    build_prefill,
    build_prefill_varlen,
    build_train,
    dynamic_cache,
    generate_kwargs,
    rewind_static_cache,
    static_cache,
    static_cache_kwargs,
)
from .decoders import _attribute as _attribute
from .decoders import _decode_case as _decode_case
from .decoders import _llama_params as _llama_params
from .decoders import _logits_of as _logits_of
from .decoders import _prefill_case as _prefill_case
from .decoders import _teacher_forced as _teacher_forced
from .decoders import _token_ids as _token_ids
from .decoders import _transformers as _transformers
from .reporting import _align as _align
from .reporting import _count as _count
from .reporting import _counts as _counts
from .reporting import _liger_version as _liger_version
from .reporting import _match as _match
from .reporting import _ms as _ms
from .reporting import _ratio as _ratio
from .reporting import _version as _version
from .reporting import (
    call_rows,
    columns,
    document,
    environment,
    listing,
    ops_lines,
    problems,
    rows,
    summary,
    table,
    table_sides,
    write_json,
    write_plot,
)
from .running import _check_side as _check_side
from .running import _legacy_fields as _legacy_fields
from .running import _release as _release
from .running import (
    choose_sides,
    counted_step,
    dispatch_counts,
    measure,
    metric_results,
    prepare_side,
    rotation,
    run_all,
    run_model,
    skip_reason,
    time_sides,
    timed_round,
)
from .sd15 import (
    SD15_FAMILY,
    SD15_FP16_TOLERANCE,
    SD15_FULL,
    SD15_GRAD_TOLERANCE,
    SD15_RUNS,
    SD15_RUNS_SMOKE,
    SD15_SMOKE,
    build_sd15_forward,
    build_sd15_train,
    build_sd15_unet,
    no_tf32,
    sd15_train_step,
)
from .sd15 import _diffusers as _diffusers
from .sd15 import _relative_norms as _relative_norms
from .sides import _MISSING as _MISSING
from .sides import (
    CompiledSide,
    FlaggemsSide,
    LigerSide,
    PatchedCompiledSide,
    PatchedSide,
    Side,
    Swap,
    as_side,
    make_side,
    run_sides,
    swapped_by,
    watched_namespaces,
)
from .unet import TF32_TOLERANCE, UNET_FULL, UNET_SMOKE, build_unet_backward, build_unet_forward, unet_stack
from .unet import _unet as _unet
from .workloads import LLAMA_TITLE, MIXTRAL_TITLE, MIXTRAL_WORKLOADS, QWEN2_TITLE, WORKLOADS, select
from .workloads import _family_workloads as _family_workloads

#: The public names, from the module that now defines each (this package was one module,
#: ``core/bench/models.py``; its private helpers are re-exported above too). The dependency probes
#: (``transformers_available``, ``liger_unavailable``, ``liger_apply``) are read through
#: :mod:`flaggems.bench.models._deps` at call time: monkeypatch them there, not here.
__all__ = [
    "PATCHED", "LIGER", "COMPILED", "PATCHED_COMPILED", "SIDE_NAMES", "DEFAULT_SIDES", "SIDES", "SMOKE_BANNER",
    "LOGITS_TOLERANCE", "GRAD_TOLERANCE", "ACCURACY_FACTOR", "ModelApiError", "Skip", "Settings", "Metric", "Check",
    "Phases", "OFF", "ModelSlot", "Case", "ModelWorkload", "MetricResult", "SideResult", "ModelResult",
    "describe_exception", "transformers_available", "LIGER_FUNCTIONS", "LIGER_OPTIONS", "liger_unavailable",
    "liger_apply", "tensors_of", "detached_copy", "close", "tokens_equal", "both", "row_errors", "Exact",
    "logits_check", "decode_check", "prefill_check", "grads_check", "UNET_FULL", "UNET_SMOKE", "TF32_TOLERANCE",
    "unet_stack", "build_unet_forward", "build_unet_backward", "SD15_FULL", "SD15_SMOKE", "SD15_RUNS",
    "SD15_RUNS_SMOKE", "SD15_FP16_TOLERANCE", "SD15_GRAD_TOLERANCE", "SD15_FAMILY", "build_sd15_unet",
    "build_sd15_forward", "no_tf32", "sd15_train_step", "build_sd15_train", "LLAMA_FULL", "LLAMA_SMOKE",
    "QWEN2_FULL", "QWEN2_SMOKE", "MIXTRAL_FULL", "MIXTRAL_SMOKE", "LLAMA_DTYPE", "RUNS_FULL", "RUNS_SMOKE",
    "VARLEN_WARMUP", "SEEN_LENGTHS", "VARLEN_SDPA", "Family", "LLAMA", "QWEN2", "MIXTRAL", "build_decoder",
    "build_llama", "build_llama_prefill", "build_prefill", "build_prefill_varlen", "build_train", "LlamaApi",
    "static_cache_kwargs", "static_cache", "rewind_static_cache", "dynamic_cache", "GreedyDecoder",
    "DECODE_METRICS", "build_llama_decode", "build_decode", "generate_kwargs", "build_llama_generate",
    "LLAMA_TITLE", "QWEN2_TITLE", "MIXTRAL_TITLE", "MIXTRAL_WORKLOADS", "WORKLOADS", "select", "as_side", "Side",
    "FlaggemsSide", "PatchedSide", "Swap", "watched_namespaces", "swapped_by", "LigerSide", "CompiledSide",
    "PatchedCompiledSide", "run_sides", "make_side", "CallCounter", "MARKER", "CountingPhases", "Census", "is_op",
    "call_activity", "device_activity", "census", "skip_reason", "dispatch_counts", "counted_step", "timed_round",
    "rotation", "time_sides", "metric_results", "prepare_side", "measure", "choose_sides", "run_model", "run_all",
    "environment", "table_sides", "columns", "rows", "call_rows", "ops_lines", "summary", "table", "problems",
    "listing", "document", "write_json", "write_plot", "cmd_models", "build_parser", "main",
]
