"""Backend descriptors built into the core and the backend selection policy.

Order (no subprocesses, no kernel compiles):

1. ``FLAGGEMS_VENDOR=<name>`` (validated). Without its hardware the vendor's
   implementations run *simulated* on the device that exists (CUDA, else the
   CPU interpreter).
2. An installed vendor backend whose probe says yes (highest priority, then name).
3. NVIDIA: a CUDA build of torch with a visible device.
4. The CPU interpreter: Triton's interpreter (``TRITON_INTERPRET=1``) on CPU
   tensors, dispatch key ``CPU``.
"""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .types import Backend, ProbeResult, resolve_callable


def probe_nvidia() -> ProbeResult:
    """Available when torch is a CUDA build and sees at least one device."""
    import torch

    if torch.version.cuda is None:
        return ProbeResult(False, "torch is not a CUDA build")
    if not torch.cuda.is_available():
        return ProbeResult(False, f"CUDA torch {torch.version.cuda} but no visible device")
    count = torch.cuda.device_count()
    return ProbeResult(True, f"CUDA {torch.version.cuda}, {count} device(s): {torch.cuda.get_device_name(0)}")


def probe_cpu() -> ProbeResult:
    """The CPU interpreter is always available (slow: for tests and demos)."""
    return ProbeResult(True, "Triton interpreter on CPU tensors (always available)")


NVIDIA = Backend("nvidia", vendor="nvidia", device_type="cuda", dispatch_key="CUDA",
                 probe=probe_nvidia, description="NVIDIA GPUs through CUDA Triton")
CPU_INTERPRETER = Backend("cpu", vendor="cpu", device_type="cpu", dispatch_key="CPU",
                          probe=probe_cpu, description="Triton interpreter on the CPU")
BUILTIN = (NVIDIA, CPU_INTERPRETER)

#: The first-party vendor packages: backend name -> (distribution, its folder in the source tree).
FIRST_PARTY = {
    "ascend": ("flaggems-ascend", "flaggems_ascend"),
    "kunlunxin": ("flaggems-kunlunxin", "flaggems_kunlunxin"),
    "hygon": ("flaggems-hygon", "flaggems_hygon"),
}


def unknown_backend_message(requested: str, known: Sequence[str]) -> str:
    """Why ``FLAGGEMS_VENDOR=requested`` names no backend, and what to do about it."""
    message = f"FLAGGEMS_VENDOR={requested!r} is not a known backend; valid: {', '.join(sorted(known))}"
    package = FIRST_PARTY.get(requested)
    if package is not None and requested not in known:
        dist, folder = package
        return (f"{message}. The {requested} backend comes with the {dist} plugin, which is not installed: "
                f"pip install ./{folder} in the flaggems source tree (or pip install {dist} where its wheel "
                "is published)")
    close = difflib.get_close_matches(requested, sorted({*known, *FIRST_PARTY}), n=2)
    return f"{message}; did you mean {' or '.join(close)}?" if close else message


@dataclass(frozen=True)
class ActiveBackend:
    """The backend chosen for this process and how it will run.

    ``device_type`` / ``dispatch_key`` are where kernels actually run; they
    differ from ``backend``'s when ``simulated`` is true.
    """

    backend: Backend
    device_type: str
    dispatch_key: str
    simulated: bool
    interpreter: bool
    reason: str
    probes: tuple[tuple[str, ProbeResult], ...] = field(default=())

    @property
    def name(self) -> str:
        """Name of the selected backend."""
        return self.backend.name

    @property
    def vendor(self) -> str:
        """Vendor whose implementations apply."""
        return self.backend.vendor


def run_probe(backend: Backend) -> ProbeResult:
    """Run a backend's probe; a probe that raises counts as unavailable."""
    try:
        result = resolve_callable(backend.probe)()
    except Exception as exc:  # noqa: BLE001 - a broken probe must not break selection
        return ProbeResult(False, f"probe raised {type(exc).__name__}: {exc}")
    if not isinstance(result, ProbeResult):
        return ProbeResult(False, f"probe returned {type(result).__name__}, not ProbeResult")
    return result


def _fallback_device() -> tuple[str, str, bool]:
    """Device type, dispatch key and interpreter flag of the hardware that exists."""
    probe = run_probe(NVIDIA)
    if probe.available:
        return "cuda", "CUDA", False
    return "cpu", "CPU", True


class BackendConflict(RuntimeError):
    """Two vendor backends' probes both say yes and ``FLAGGEMS_VENDOR`` does not choose."""

    def __init__(self, claims: Sequence[Backend]) -> None:
        super().__init__(", ".join(b.name for b in claims))
        self.claims = tuple(claims)


def select(vendor_backends: Sequence[Backend], requested: str = "",
           owners: Mapping[str, str] | None = None) -> ActiveBackend:
    """Choose the active backend (see the module docstring for the order).

    ``owners`` maps a vendor backend to its plugin: when backends of two plugins
    both find their device and none is requested, :class:`BackendConflict` is raised.
    """
    candidates = {b.name: b for b in (*vendor_backends, *BUILTIN)}
    probes = tuple((b.name, run_probe(b)) for b in candidates.values())
    answers = dict(probes)
    if requested:
        if requested not in candidates:
            raise ValueError(unknown_backend_message(requested, list(candidates)))
        chosen = candidates[requested]
        if answers[requested].available:
            return _activate(chosen, False, f"FLAGGEMS_VENDOR={requested}", probes)
        device, key, interp = _fallback_device()
        return ActiveBackend(chosen, device, key, True, interp,
                             f"FLAGGEMS_VENDOR={requested}; no {chosen.device_type} device "
                             f"({answers[requested].reason}): simulated on {device}", probes)
    vendors = sorted((b for b in vendor_backends if answers[b.name].available),
                     key=lambda b: (-b.priority, b.name))
    if owners is not None and len({owners.get(b.name) for b in vendors}) > 1:
        raise BackendConflict(vendors)
    if vendors:
        return _activate(vendors[0], False, f"probe: {answers[vendors[0].name].reason}", probes)
    if answers["nvidia"].available:
        return _activate(NVIDIA, False, f"probe: {answers['nvidia'].reason}", probes)
    return _activate(CPU_INTERPRETER, False, "no GPU backend available", probes)


def triton_has_driver(device_type: str) -> bool:
    """Whether an installed Triton backend drives ``device_type`` devices (CUDA/HIP: torch's cuda type)."""
    if device_type == "cpu":
        return False
    if device_type == "cuda":
        return True
    try:
        from triton.backends import backends
    except ImportError:
        return False
    for entry in backends.values():
        try:
            if entry.driver.is_active() and getattr(entry.driver, "get_current_target", None) is not None and \
                    device_type in str(entry.driver.get_current_target().backend):
                return True
        except Exception:  # noqa: BLE001, S112 - a backend that cannot answer does not drive the device
            continue
    return False


def _activate(backend: Backend, simulated: bool, reason: str,
              probes: tuple[tuple[str, ProbeResult], ...]) -> ActiveBackend:
    interp = not triton_has_driver(backend.device_type)
    if interp and backend.device_type != "cpu":
        reason += f"; no Triton driver for {backend.device_type!r} devices: kernels run in Triton's interpreter"
    return ActiveBackend(backend, backend.device_type, backend.dispatch_key, simulated, interp, reason, probes)


#: What :func:`prepare_interpreter` changed, so that selecting a driven backend later undoes it:
#: ``env`` is ``TRITON_INTERPRET``'s value before (``None``: unset), ``helpers`` the replaced attributes.
_INTERPRETER_CHANGES: dict[str, object] = {}


def prepare_interpreter(active: ActiveBackend) -> None:
    """Make Triton use its interpreter when kernels run on CPU tensors (and undo that for a driven backend).

    Triton decides at decoration time (``@triton.jit``) whether a function is
    interpreted, so this must run before any kernel module is imported. The
    core imports kernel modules lazily (at ``enable()``), after this call.
    Selecting a backend with a Triton driver afterwards (tests switch
    backends in one process) restores ``TRITON_INTERPRET`` and Triton's own
    helpers: left interpreted, every kernel compiled for the GPU after that
    would call interpreted helpers and fail to compile.
    """
    if active.interpreter:
        if "env" not in _INTERPRETER_CHANGES:
            _INTERPRETER_CHANGES["env"] = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        if "triton" in sys.modules:
            _interpret_triton_library()
    elif _INTERPRETER_CHANGES:
        _restore_compiled_mode()


def _restore_compiled_mode() -> None:
    before = _INTERPRETER_CHANGES.pop("env", None)
    if before is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = str(before)
    for module, attr, original in _INTERPRETER_CHANGES.pop("helpers", []):  # type: ignore[union-attr]
        setattr(module, attr, original)


def _interpret_triton_library() -> None:
    """Triton was imported before the interpreter was chosen: interpret its own ``@jit`` helpers too.

    ``tl.sum``, ``tl.cdiv``, ``tl.cumsum``'s combine functions... are decorated
    when ``triton.language`` is imported. Imported without ``TRITON_INTERPRET``
    they are compiled-mode ``JITFunction`` objects, which an interpreted kernel
    cannot call ("Cannot call @triton.jit'd outside of the scope of a kernel",
    triton 3.9). Each is replaced, in every loaded ``triton.language`` module,
    by the interpreted function that decorating it now would have produced
    (the originals are kept for :func:`_restore_compiled_mode`).
    """
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    replaced: dict[int, InterpretedFunction] = {}
    helpers = _INTERPRETER_CHANGES.setdefault("helpers", [])
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "triton.language" or name.startswith("triton.language.")):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                if id(value) not in replaced:
                    replaced[id(value)] = InterpretedFunction(
                        value.fn, version=value.version, do_not_specialize=value.do_not_specialize,
                        debug=value.debug, noinline=value.noinline)
                helpers.append((module, attr, value))  # type: ignore[union-attr]
                setattr(module, attr, replaced[id(value)])
