"""Contract cases of ``flaggems::layer_scale(x, gamma)``.

Hidden states as a ViT block passes them (``[batch, tokens, hidden]``, hidden
384 to 1024 and an odd size), a single token, a sliced (not dense) input, and
a strided gamma, an empty input, and the calls the kernel declines (float64, a
gamma that is no vector of the hidden size, mixed dtypes). Tolerance: the kernel rounds once, as torch does (0 ulps);
bfloat16 gets one ulp, the interpreter's truncating store.
"""

from __future__ import annotations

import torch

from flaggems.types import Case

OP = "flaggems::layer_scale"


def _case(name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32, *, gamma_shape=None,
          gamma_dtype=None, sliced: bool = False, gamma_step: int = 1, **kw) -> Case:
    def make(dev):
        x = torch.randn(shape[:-1] + (2 * shape[-1] if sliced else shape[-1],), dtype=dtype, device=dev)
        x = x[..., ::2] if sliced else x
        wide = tuple(gamma_shape or shape[-1:])
        gamma = torch.rand(wide[:-1] + (wide[-1] * gamma_step,), dtype=gamma_dtype or dtype, device=dev) + 0.5
        return (x, gamma[..., ::gamma_step]), {}

    ulps = 1.0 if dtype == torch.bfloat16 else 0.0
    return Case(name, make, ulps=ulps, **kw)


CASES = {OP: [
    _case("vit-s-fp32", (2, 197, 384)),
    _case("vit-b-bf16", (2, 197, 768), torch.bfloat16),
    _case("vit-l-fp16", (1, 257, 1024), torch.float16),
    _case("one-token-odd-hidden", (1, 1, 999)),
    _case("sliced-input", (3, 5, 64), sliced=True),
    _case("strided-gamma", (3, 5, 64), gamma_step=3),
    _case("empty-input", (0, 5, 64)),
    _case("declined-fp64", (2, 4, 8), torch.float64),
    _case("declined-broadcast-gamma", (2, 4, 8), gamma_shape=(1,)),
    _case("declined-mixed-dtypes", (2, 4, 8), torch.bfloat16, gamma_dtype=torch.float32),
]}
