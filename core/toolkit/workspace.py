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

A caller whose launches are more than one (the state set by the first, reset
by the last) takes the buffer with :func:`claim_scratch` and holds its lock
from the first launch to the last: another thread on the same stream could
otherwise put its own launches in between (Triton's launch releases the GIL),
and they would find the state set.

A CUDA graph captured around such launches holds the buffer's address and
stays correct on replay, since the launches reset the buffer themselves. A buffer
that is outgrown is kept alive (a captured graph may still use it) and a
larger one replaces it. Two replays of graphs captured on one stream must not
run concurrently on different streams (they would share one buffer).
"""

from __future__ import annotations

import threading

import torch

from . import recording
from .launch import _device

#: Words in a first buffer: enough for the common cases, so that it is rarely regrown.
MIN_WORDS = 4096

_BUFFERS: dict[tuple[str, int, int], torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []
_LOCKS: dict[tuple[str, int, int], threading.Lock] = {}


def _stream_key(like: torch.Tensor) -> tuple[str, int, int]:
    device = like.device
    if device.type == "cpu":
        return ("cpu", -1, 0)
    index = like.get_device()
    if device.type == "cuda":
        return (device.type, index, _device().stream(index))
    # Any other device (a PrivateUse1 backend, possibly without a Triton driver): torch's generic stream.
    return (device.type, index, torch.accelerator.current_stream(device).stream_id)


def _buffer(key: tuple[str, int, int], like: torch.Tensor, words: int) -> torch.Tensor:
    buffer = _BUFFERS.get(key)
    if buffer is None or buffer.numel() < words:
        if buffer is not None:
            _OUTGROWN.append(buffer)
        size = max(words, MIN_WORDS, 2 * buffer.numel() if buffer is not None else 0)
        buffer = _BUFFERS[key] = torch.zeros(size, dtype=torch.int64, device=like.device)
    return buffer


def _pinned(like: torch.Tensor, words: int, key: tuple[str, int, int]) -> torch.Tensor | None:
    """While a call is recorded for the compiled entry: a buffer its plan owns (CPU and CUDA only), else None."""
    rec = recording.current()
    if rec is None:
        return None
    if key[0] not in ("cpu", "cuda"):
        rec.spoil(f"state buffer on {key[0]}: the replay keys streams of CPU and CUDA only")
        return None
    return rec.pin(like, words, key[2])


def zeroed_scratch(like: torch.Tensor, words: int) -> torch.Tensor:
    """An int64 buffer of at least ``words`` zeros on ``like``'s device, for the current stream.

    The caller's launches must leave every word they touched zero when they end.
    The first call per stream (or one that needs more words) allocates it with
    ``torch.zeros``; later calls are one dictionary lookup. A call being
    recorded for the compiled entry gets a buffer of its plan instead
    (:meth:`.recording.Recording.pin`): the replays use it, on that stream.
    """
    key = _stream_key(like)
    pinned = _pinned(like, words, key)
    return _buffer(key, like, words) if pinned is None else pinned


def claim_scratch(like: torch.Tensor, words: int) -> tuple[torch.Tensor, threading.Lock]:
    """:func:`zeroed_scratch`'s buffer and the current stream's lock on it.

    Hold the lock (``with lock:``) from the first launch that sets words to
    the last that zeroes them: a call of another thread on the same stream
    then waits instead of launching in between. One lock per stream, so
    threads on different streams never wait for each other.
    """
    key = _stream_key(like)
    lock = _LOCKS.get(key)
    if lock is None:
        lock = _LOCKS.setdefault(key, threading.Lock())
    pinned = _pinned(like, words, key)
    return (_buffer(key, like, words) if pinned is None else pinned), lock
