"""A transformers decode step captured in a CUDA graph with flaggems enabled replays correctly (GPU only).

How transformers users cut host time (``torch.compile(mode="reduce-overhead")``, or ``torch.cuda.graphs``
by hand): prefill eagerly into a ``StaticCache``, then replay one captured decode step per token. The KV
cache writes (``index_copy_``) and every other routed op run inside the graph through flaggems' compiled
entry; the logits and greedy tokens must equal eager torch's.
"""

from __future__ import annotations

import pytest
import torch
from conftest import set_kernel_context

import flaggems
from flaggems.bench import models

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not models.transformers_available(), reason="needs transformers"),
]
STEPS = 8
PARAMS = {"layers": 2, "hidden": 256, "intermediate": 512, "heads": 8, "kv_heads": 2, "vocab": 1024}


def _eager(model, prompt, steps):
    """Greedy decode, every step eager: (per-step logits, tokens)."""
    decoder = models.GreedyDecoder(model, prompt, steps + 1)
    with torch.no_grad():
        decoder.cache.reset()
        token = decoder.forward(prompt, 0, last_only=True)[:, -1].argmax(-1, keepdim=True)
        logits, tokens = [], [token]
        for i in range(steps):
            step = decoder.forward(token, prompt.shape[1] + i)[:, -1].float()
            token = step.argmax(-1, keepdim=True)
            logits.append(step)
            tokens.append(token)
    return torch.stack(logits), torch.cat(tokens, dim=1)


def _graphed(model, prompt, steps):
    """Prefill and two warm-up decode steps eager, then one decode step captured and replayed per token."""
    decoder = models.GreedyDecoder(model, prompt, steps + 1)
    length = prompt.shape[1]
    with torch.no_grad():
        decoder.cache.reset()
        token = decoder.forward(prompt, 0, last_only=True)[:, -1].argmax(-1, keepdim=True)
        logits, tokens = [], [token]
        for i in range(2):  # warm-up: plans made, lazy state allocated
            step = decoder.forward(token, length + i)[:, -1].float()
            token = step.argmax(-1, keepdim=True)
            logits.append(step)
            tokens.append(token)
        ids = token.clone()
        positions = torch.tensor([length + 2], device=prompt.device)
        kwargs = {decoder.api.cache_kwarg: decoder.cache, "use_cache": True}
        if decoder.api.cache_position:
            kwargs["cache_position"] = positions
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            captured = model(input_ids=ids, **kwargs).logits[:, -1].float()
        for _ in range(steps - 2):
            graph.replay()
            step = captured.clone()
            token = step.argmax(-1, keepdim=True)
            logits.append(step)
            tokens.append(token)
            ids.copy_(token)
            positions.add_(1)
    return torch.stack(logits), torch.cat(tokens, dim=1)


def test_a_graphed_static_cache_decode_equals_eager_torch(monkeypatch):
    set_kernel_context(monkeypatch, checks=False)  # index checks synchronise: none inside a capture
    device = torch.device("cuda")
    model = models.build_llama(device, PARAMS)
    prompt = torch.randint(0, PARAMS["vocab"], (2, 12), generator=torch.Generator().manual_seed(3)).to(device)
    flaggems.disable()
    want_logits, want_tokens = _eager(model, prompt, STEPS)
    with flaggems.enabled():
        got_logits, got_tokens = _graphed(model, prompt, STEPS)
        stats = flaggems.runtime.RUNTIME.plan_stats()
    assert torch.equal(got_tokens, want_tokens)
    error = ((got_logits - want_logits).abs().amax(-1) / want_logits.abs().amax(-1)).max().item()
    assert error <= 2e-2, f"max relative logit error {error}"
    assert sum(row["replay"] for row in stats.values()) > 0, "no routed call replayed"
