"""Builds and loads flaggems' compiled dispatcher entry (``entry.cpp``).

The entry is compiled on first use against the torch that is running, with
torch's own extension tooling (``torch.utils.cpp_extension.load``: a C++
compiler and ninja), and cached under torch's extension directory
(``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``) in a folder
named after a hash of what the build depends on (:func:`_build_name`): the
source, torch's version and C++ ABI, the interpreter's ABI and environment, the
flags, and the compiler's and ninja's versions, not the PATH that found them. A
torch upgrade, a new flaggems, another compiler or another environment builds
anew; a second process loads the cached library in well under a second. ``flaggems build``
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
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
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


#: The compiler flags of the build (they key it too).
CFLAGS = ("-O2",)

#: ``{(command, path, realpath, size, mtime): identity}``: each tool is asked its version once per process.
_IDENTITIES: dict[tuple[str, str, str, int, int], str] = {}


def compiler() -> str:
    """The C++ compiler torch's extension tooling runs: ``$CXX``, else ``c++`` (as its ``get_cxx_compiler``)."""
    return os.environ.get("CXX", "c++")


def _executable(command: str | None) -> str | None:
    """The path of a command's program (``CXX="ccache g++"`` runs ``ccache``), ``None`` when absent."""
    words = shlex.split(command) if command else []
    return shutil.which(words[0]) if words else None


def _tool_identity(command: str | None) -> str:
    """What a tool is, independent of the PATH that found it ('' when absent).

    Its ``--version`` output (without the program's own name, which gcc echoes): the same ninja through a
    symlink, a wrapper or a copy is the same tool, another version is another build. A program that cannot
    say its version is identified by its file (resolved path, size, modification time).
    """
    path = _executable(command)
    if path is None:
        return ""
    real = os.path.realpath(path)
    stat = os.stat(real)
    key = (command, path, real, stat.st_size, stat.st_mtime_ns)
    if key not in _IDENTITIES:
        _IDENTITIES[key] = (_version_of([path, *shlex.split(command)[1:]])
                            or f"{real}:{stat.st_size}:{stat.st_mtime_ns}")
    return _IDENTITIES[key]


def _version_of(argv: list[str]) -> str:
    """``argv --version``'s output ('' when it fails), its leading program name dropped."""
    try:
        done = subprocess.run([*argv, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    if done.returncode != 0:
        return ""
    text = done.stdout.strip() or done.stderr.strip()
    return text.removeprefix(os.path.basename(argv[0]) + " ")


def _build_name() -> str:
    """The cache folder's name: a hash of what the build depends on.

    The source, torch's version and C++ ABI, the interpreter (its ABI, and its
    prefix: each virtual environment builds its own), the flags, and the
    compiler's and ninja's identities (:func:`_tool_identity`). Two environments
    sharing the cache with different ninja versions rebuilt the entry in turn,
    each rejecting the other's build log; one environment run with and without
    ``activate`` must not (its ninja is found through another PATH).
    """
    import torch

    _put_pip_ninja_on_path()
    digest = hashlib.sha256(SOURCE.read_bytes())
    for part in PARTS:
        digest.update(part.read_bytes())
    abi = getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", "")
    python = f"{sys.version_info[:2]}|{sysconfig.get_config_var('EXT_SUFFIX')}|{sys.prefix}"
    digest.update(f"{torch.__version__}|{abi}|{python}|{CFLAGS}|{_tool_identity(compiler())}|"
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
    """Why the entry cannot be built here (the compiler torch would run, or ninja, is missing), or ``None``."""
    from torch.utils import cpp_extension

    command = compiler()
    if _executable(command) is None:
        if "CXX" in os.environ:
            return f"no C++ compiler: CXX={command!r} is not an executable; fix CXX or unset it"
        return (f"no C++ compiler: {command!r} is not on PATH (torch builds with $CXX, default c++); "
                f"install one (e.g. g++) or set CXX")
    _put_pip_ninja_on_path()
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    return None


#: Lines of a failed build that explain it (the compiler's or the shell's words, not ninja's bookkeeping).
_EXPLAINS = re.compile(r"error|not found|no such file|cannot|undefined|fatal|permission denied", re.IGNORECASE)
#: torch's prefix before the build's output, on the output's first line.
_TORCH_PREFIX = re.compile(r"^Error building extension '[^']*':\s*")


def failure_reason(exc: BaseException, lines: int = 3) -> str:
    """``build failed: ...`` with the first lines of the build's output that say why.

    torch raises ``RuntimeError("Error building extension ...: <ninja's output>")``, whose last line is
    only ``ninja: build stopped: subcommand failed.``; the cause (``c++: not found``, the compiler's
    ``error:`` lines) is above it, after ninja's progress line and the failed command.
    """
    text = _TORCH_PREFIX.sub("", str(exc).strip())
    said = _said_by_tools(text.splitlines())
    explaining = [line for line in said if _EXPLAINS.search(line)] or said
    picked = explaining[:lines] or [text.splitlines()[-1] if text else type(exc).__name__]
    return "build failed: " + "; ".join(picked)


def _said_by_tools(output: list[str]) -> list[str]:
    """The output's lines without ninja's own: progress (``[1/2] ...``), ``FAILED:``, the command after it,
    ``ninja: build stopped``."""
    kept, after_failed = [], False
    for line in (line.strip() for line in output):
        if after_failed or not line or re.match(r"\[\d+/\d+\]", line) or line.startswith("ninja: "):
            after_failed = False
            continue
        after_failed = line.startswith("FAILED:")
        if not after_failed:
            kept.append(line)
    return kept


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
    return cpp_extension.load(name, sources=[str(SOURCE)], extra_cflags=list(CFLAGS), build_directory=str(folder),
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
        return False, str(folder), failure_reason(exc)
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
        reason = failure_reason(exc)
        log.logger("plugins").warning("flaggems: compiled entry unavailable (%s); using the Python entry", reason)
        return None, reason
    from ..toolkit import plans

    # Before any registry parses a plan: the entry reads the records' fields where Python defines them.
    module.set_layout(plans.field_layout(), plans.TAGS)
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
            missing = _missing_tools()
            if missing is not None:
                return "python", f"cannot build: {missing}"
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
