"""Builds and loads flaggems' compiled dispatcher entry (``entry.cpp``).

The entry is compiled on first use against the torch that is running, with
torch's own extension tooling (``torch.utils.cpp_extension.load``: a C++
compiler and ninja), and cached under torch's extension directory
(``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``) in a folder
named after a hash of the source, torch's version and ABI, the interpreter's
environment and the compiler and ninja binaries (:func:`_build_name`): a
torch upgrade, a new flaggems or another environment builds anew, a second
process loads the cached library in well under a second. ``flaggems build``
builds it ahead of time. It needs no CUDA toolkit: the CUDA driver is
opened at run time. Built at install time instead, it would need torch in
the build environment (build isolation would pull a second torch) and would
break with the next torch upgrade.

``FLAGGEMS_ENTRY`` chooses: ``auto`` (default: compiled where it builds,
else the Python entry, with the reason in ``flaggems info``), ``compiled``
(a build failure is an error) or ``python``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import threading
from pathlib import Path
from types import ModuleType

from .. import config, log

SOURCE = Path(__file__).with_name("entry.cpp")
#: The source's parts (``entry_*.inc``, included by ``entry.cpp``): all of them key the build.
PARTS = tuple(sorted(SOURCE.parent.glob("entry_*.inc")))

_LOCK = threading.Lock()
_STATE: dict[str, object] = {}
_BUILT: list[ModuleType] = []  # a built module stays loaded across resets (an extension loads once per process)


def _tool_identity(name: str | None) -> str:
    """A tool's resolved path, size and modification time ('' when absent): another binary, another build."""
    path = shutil.which(name) if name else None
    if path is None:
        return ""
    path = os.path.realpath(path)
    stat = os.stat(path)
    return f"{path}:{stat.st_size}:{stat.st_mtime_ns}"


def _build_name() -> str:
    """The cache folder's name: a hash of what the build depends on.

    The source, torch's version and C++ ABI, the interpreter (its prefix: each
    virtual environment builds its own) and the compiler and ninja binaries.
    Two environments sharing the cache with different ninja versions rebuilt
    the entry in turn, each rejecting the other's build log (~40 s a time).
    """
    import torch

    _put_pip_ninja_on_path()
    digest = hashlib.sha256(SOURCE.read_bytes())
    for part in PARTS:
        digest.update(part.read_bytes())
    abi = getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", "")
    compiler = _tool_identity(os.environ.get("CXX", "c++")) or _tool_identity("g++")
    digest.update(f"{torch.__version__}|{abi}|{sys.version_info[:2]}|{sys.prefix}|{compiler}|"
                  f"{_tool_identity('ninja')}".encode())
    return f"flaggems_entry_{digest.hexdigest()[:16]}"


def _put_pip_ninja_on_path() -> None:
    """torch's tooling runs ``ninja`` from PATH; the pip package's binary sits in the environment's scripts
    folder, which is not on PATH when that environment's python is run directly."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return
    folder = getattr(ninja, "BIN_DIR", None)
    if folder and os.path.exists(os.path.join(folder, "ninja")):
        os.environ["PATH"] = folder + os.pathsep + os.environ.get("PATH", "")


def _missing_tools() -> str | None:
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None and shutil.which("g++") is None:
        return f"no C++ compiler ({compiler!r} not on PATH)"
    _put_pip_ninja_on_path()
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    return None


def _folder() -> tuple[str, Path]:
    name = _build_name()
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    return name, root / name


def is_built() -> bool:
    """Whether this torch's build of the entry is in the cache already (loading it then takes < 1 s)."""
    name, folder = _folder()
    return any(folder.glob(f"{name}*.so"))


def _build() -> ModuleType:
    from torch.utils import cpp_extension

    name, folder = _folder()
    folder.mkdir(parents=True, exist_ok=True)
    if not is_built():
        print(f"flaggems: compiling the compiled entry for torch {_torch_version()} (once per environment, "
              f"about 40-80 s on two CPU cores; `flaggems build` does it ahead of time) in {folder}",
              file=sys.stderr, flush=True)
    return cpp_extension.load(name, sources=[str(SOURCE)], extra_cflags=["-O2"], build_directory=str(folder),
                              verbose=False)


def build() -> tuple[bool, str, str]:
    """Build (or find) the compiled entry now: ``(ok, folder, reason)``; never raises for a failed build."""
    _, folder = _folder()
    missing = _missing_tools()
    if missing is not None:
        return False, str(folder), f"cannot build: {missing}"
    try:
        module = _BUILT[0] if _BUILT else _build()
        _BUILT[:] = [module]
    except Exception as exc:  # noqa: BLE001 - reported to the user, who keeps the Python entry
        return False, str(folder), f"build failed: {type(exc).__name__}: {str(exc).strip().splitlines()[-1:]}"
    return True, str(folder), f"built against torch {_torch_version()}"


def _torch_version() -> str:
    import torch

    return torch.__version__


def load() -> tuple[ModuleType | None, str]:
    """The compiled entry's module (built if needed) and why, or ``None`` and why not."""
    with _LOCK:
        if "result" not in _STATE:
            _STATE["result"] = _load()
        return _STATE["result"]  # type: ignore[return-value]


def _load() -> tuple[ModuleType | None, str]:
    choice = config.get("FLAGGEMS_ENTRY")
    if choice == "python":
        return None, "FLAGGEMS_ENTRY=python"
    missing = _missing_tools()
    if missing is not None:
        if choice == "compiled":
            raise RuntimeError(f"FLAGGEMS_ENTRY=compiled, but the compiled entry cannot be built: {missing}")
        return None, f"cannot build: {missing}"
    try:
        module = _BUILT[0] if _BUILT else _build()
        _BUILT[:] = [module]
    except Exception as exc:  # noqa: BLE001 - any build failure leaves the Python entry working
        if choice == "compiled":
            raise
        reason = f"build failed: {type(exc).__name__}: {str(exc).strip().splitlines()[-1:]}"
        log.logger("plugins").warning("flaggems: compiled entry unavailable (%s); using the Python entry", reason)
        return None, reason
    available, driver = module.driver()
    launches = "CUDA launches through " + driver if available else f"no CUDA driver ({driver})"
    return module, f"built against torch {_torch_version()}; {launches}"


def status() -> tuple[str, str]:
    """``(entry, reason)`` without building: what :func:`load` decided, or will decide at ``enable()``."""
    result = _STATE.get("result")
    if result is None:
        if config.get("FLAGGEMS_ENTRY") == "python":
            return "python", "FLAGGEMS_ENTRY=python"
        if not is_built():
            return "python (until enable())", "the compiled entry is built at the first enable()"
        result = load()
    module, reason = result  # type: ignore[misc]
    return ("compiled" if module is not None else "python"), reason


def loaded() -> ModuleType | None:
    """The module if :func:`load` already loaded it (never builds)."""
    result = _STATE.get("result")
    return result[0] if result else None  # type: ignore[index]


_GENERATION = [0]


def generation() -> int:
    """How many times :func:`reset` ran: plans kept by an earlier load are not reused after one."""
    return _GENERATION[0]


def reset() -> None:
    """Forget the load decision (tests change ``FLAGGEMS_ENTRY``)."""
    with _LOCK:
        _STATE.clear()
        _GENERATION[0] += 1
