"""Zeroed scratch for kernels whose programs talk to each other, without a memset per call.

A kernel whose programs coordinate (e.g. partial sums published for later
programs, as in a decoupled look-back scan) needs state that is zero when it
starts. Allocating it zeroed on every call puts one more operation (a memset)
on the stream before the kernel. Instead, :func:`zeroed_scratch` hands out one
int64 buffer per (device, stream) that is zero when handed out, under a
contract every caller keeps: **the words it used are zero again when its
launches end** (cleared by the kernel's last program, or, as repeat_interleave
does, by the launch that follows it on the same stream). Calls on one stream
run in order, so the next caller finds it zeroed; another stream gets another
buffer.

A CUDA graph captured around such launches holds the buffer's address and
stays correct on replay, since the launches reset the buffer themselves. A buffer
that is outgrown is kept alive (a captured graph may still use it) and a
larger one replaces it. Two replays of graphs captured on one stream must not
run concurrently on different streams (they would share one buffer).
"""

from __future__ import annotations

import torch

from .launch import _device

#: Words in a first buffer: enough for the common cases, so that it is rarely regrown.
MIN_WORDS = 4096

_BUFFERS: dict[tuple[str, int, int], torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []


def _stream_key(like: torch.Tensor) -> tuple[str, int, int]:
    device = like.device
    if device.type == "cpu":
        return ("cpu", -1, 0)
    index = like.get_device()
    return (device.type, index, _device().stream(index))


def zeroed_scratch(like: torch.Tensor, words: int) -> torch.Tensor:
    """An int64 buffer of at least ``words`` zeros on ``like``'s device, for the current stream.

    The caller's launches must leave every word they touched zero when they end.
    The first call per stream (or one that needs more words) allocates it with
    ``torch.zeros``; later calls are one dictionary lookup.
    """
    key = _stream_key(like)
    buffer = _BUFFERS.get(key)
    if buffer is None or buffer.numel() < words:
        if buffer is not None:
            _OUTGROWN.append(buffer)
        size = max(words, MIN_WORDS, 2 * buffer.numel() if buffer is not None else 0)
        buffer = _BUFFERS[key] = torch.zeros(size, dtype=torch.int64, device=like.device)
    return buffer
