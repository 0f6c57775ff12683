"""First use and bad input, the remainder (issue 64).

Each test is one defect a user reported: the compiled entry built twice for one
environment (with and without ``activate``), a build without a compiler that
said only ``ninja: build stopped``, commands that ran (or half ran) on a
configuration ``enable()`` refuses, a strict error saying it used the default
chain, ``include="index_select"`` read as its characters, and ``routes --op
rms_norm`` not finding ``flaggems::rms_norm``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import flaggems
from flaggems import OpImpl, cli, compiled, config, hookimpl, policy
from flaggems.policy import PolicyError
from flaggems.runtime import RUNTIME, op_names
from flaggems.testing import random_cases
from flaggems_fakes.plugins import GenericNeg

K = "flaggems_fakes.kernels"


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLAGGEMS_") and k != "CXX"}
    return {**env, **extra}


def _script(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + text)
    path.chmod(0o755)
    return path


def _real_ninja() -> str:
    compiled._put_pip_ninja_on_path()
    found = shutil.which("ninja")
    if found is None:
        pytest.skip("no ninja here")
    return os.path.realpath(found)


@pytest.fixture
def fresh_entry(monkeypatch):
    """The compiled entry's load decision and built module forgotten for one test (restored after)."""
    monkeypatch.setattr(compiled, "_STATE", {})
    monkeypatch.setattr(compiled, "_BUILT", [])
    return compiled


# -- 1. the build's cache key: what changes the build, not the PATH that found the tools ------------------
def test_the_same_ninja_through_another_path_keys_the_same_build(tmp_path, monkeypatch):
    """With ``activate``, PATH finds the environment's ninja; without it, the pip package's binary (or
    another copy, or a wrapper): one build, not two."""
    real = _real_ninja()
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "ninja").symlink_to(real)
    copied = tmp_path / "copied"
    copied.mkdir()
    shutil.copy(real, copied / "ninja")  # another path, another modification time, the same version
    wrapped = _script(tmp_path / "wrapped" / "ninja", f'exec {real} "$@"\n').parent
    path = os.environ["PATH"]
    names = {compiled._build_name()}
    for folder in (linked, copied, wrapped):
        monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{path}")
        names.add(compiled._build_name())
    assert len(names) == 1, names
    other = _script(tmp_path / "other" / "ninja", "echo 0.0.1\n").parent
    monkeypatch.setenv("PATH", f"{other}{os.pathsep}{path}")
    assert compiled._build_name() not in names, "another ninja version must key another build"


def test_the_key_follows_the_compiler_torch_uses_and_the_flags(tmp_path, monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    first = compiled._build_name()
    default = shutil.which("c++")
    if default is not None:
        monkeypatch.setenv("CXX", default)  # the same compiler, spelled by its path
        assert compiled._build_name() == first
    monkeypatch.setenv("CXX", str(_script(tmp_path / "g++", 'echo "g++ (other) 1.0.0"\n')))
    assert compiled._build_name() != first, "another compiler must key another build"
    monkeypatch.delenv("CXX")
    monkeypatch.setattr(compiled, "CFLAGS", ("-O3",))
    assert compiled._build_name() != first, "other flags must key another build"


# -- 2. a build that cannot happen, or fails, says why ---------------------------------------------------
def test_a_missing_compiler_is_named_before_any_build(fresh_entry, monkeypatch, capsys):
    """``CXX`` names the compiler torch runs: a ``g++`` elsewhere on PATH must not hide that it is missing."""
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    monkeypatch.setenv("FLAGGEMS_ENTRY", "auto")
    monkeypatch.setattr(compiled, "_build", lambda: pytest.fail("the missing compiler must stop the build first"))
    ok, _, reason = compiled.build()
    assert not ok and reason == ("cannot build: no C++ compiler: CXX='/nonexistent/g++' is not an executable; "
                                 "fix CXX or unset it")
    assert cli.main(["build"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"flaggems build: {reason}\n") and "RuntimeError" not in err
    assert compiled.status() == ("python", reason)
    assert cli.main(["info"]) == 0
    assert f"entry: python  ({reason})" in capsys.readouterr().out
    assert compiled.load() == (None, reason)


def test_the_commands_name_a_missing_compiler(tmp_path):
    env = _clean_env(CXX="/nonexistent/g++", TORCH_EXTENSIONS_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "flaggems", "build"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 1, done.stderr
    assert "no C++ compiler: CXX='/nonexistent/g++'" in done.stderr and "Traceback" not in done.stderr
    done = subprocess.run([sys.executable, "-m", "flaggems", "info"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "entry: python  (cannot build: no C++ compiler: CXX='/nonexistent/g++'" in done.stdout


def _failing_compiler(folder: Path) -> Path:
    """A ``g++`` that says its version and fails every compile the way a broken toolchain does (no build runs)."""
    return _script(folder / "g++", f"""case "$*" in
  *-dump*) echo 12.2.0; exit 0;;
  *--version*) echo "g++ (fake {folder}) 12.2.0"; exit 0;;
esac
echo "In file included from entry.cpp:1:" >&2
echo "entry.cpp:1:10: fatal error: torch/extension.h: No such file or directory" >&2
echo "compilation terminated." >&2
exit 1
""")


def test_a_failed_build_quotes_the_compilers_error(fresh_entry, tmp_path, monkeypatch, capsys):
    _real_ninja()
    monkeypatch.setenv("CXX", str(_failing_compiler(tmp_path / "bin")))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    assert cli.main(["build"]) == 1
    err = capsys.readouterr().err
    assert "flaggems build: build failed: entry.cpp:1:10: fatal error: torch/extension.h: No such file" in err
    assert "ninja: build stopped" not in err


def test_the_entry_line_quotes_the_compilers_error(fresh_entry, tmp_path, monkeypatch):
    """What ``enable()`` decided after a failed build is what ``flaggems info`` says."""
    _real_ninja()
    monkeypatch.setenv("CXX", str(_failing_compiler(tmp_path / "bin")))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setenv("FLAGGEMS_ENTRY", "auto")
    module, reason = compiled.load()
    assert module is None
    assert reason == "build failed: entry.cpp:1:10: fatal error: torch/extension.h: No such file or directory"
    assert compiled.status() == ("python", reason)


def test_the_failure_reason_skips_ninjas_bookkeeping():
    output = ("Error building extension 'flaggems_entry_0': [1/2] c++ -MMD -MF entry.o.d -c entry.cpp -o entry.o \n"
              "FAILED: [code=127] entry.o \nc++ -MMD -MF entry.o.d -c entry.cpp -o entry.o \n"
              "/bin/sh: 1: c++: not found\nninja: build stopped: subcommand failed.\n")
    assert compiled.failure_reason(RuntimeError(output)) == "build failed: /bin/sh: 1: c++: not found"
    assert compiled.failure_reason(ImportError("libx.so: cannot open shared object file")) == \
        "build failed: libx.so: cannot open shared object file"


# -- 3. a configuration enable() refuses: every command refuses it first -----------------------------------
def test_routes_refuses_an_unknown_log_channel(monkeypatch, capsys):
    monkeypatch.setenv("FLAGGEMS_LOG", "dispatch,bogus")
    assert set(config.problems()) == {"FLAGGEMS_LOG"}
    assert cli.main(["routes"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "unknown channel(s) ['bogus']" in captured.err and "routes refuses this configuration" in captured.err


@pytest.mark.parametrize("command", [["routes", "--op", "copy_"], ["kit", "--op", "neg"], ["build"]])
def test_every_working_command_refuses_before_it_works(monkeypatch, capsys, command):
    monkeypatch.setenv("FLAGGEMS_STRICT", "maybe")
    monkeypatch.setattr(random_cases, "run_kit", lambda *a, **k: pytest.fail("the kit ran cases before refusing"))
    monkeypatch.setattr(compiled, "build", lambda: pytest.fail("flaggems build built before refusing"))
    monkeypatch.setattr(flaggems, "routes", lambda *a: pytest.fail("flaggems routes routed before refusing"))
    assert cli.main(command) == 2
    captured = capsys.readouterr()
    assert captured.out == "", "nothing may run (the kit's banner included)"
    assert "FLAGGEMS_STRICT='maybe' is not a boolean" in captured.err
    assert f"{command[0]} refuses this configuration, as enable() does (FLAGGEMS_STRICT)" in captured.err


def _routes_file(tmp_path: Path, name: str) -> str:
    files = {
        "missing": None,
        "a folder": None,
        "not TOML": "copy_ = \n",
        "a number": "copy_ = 1\n",
        "an empty route": 'copy_ = " "\n',
        "a table under an op": '[copy_]\nroute = "native"\n',
        "routes not a table": 'routes = "native"\n',
    }
    path = tmp_path / "routes.toml"
    if name == "a folder":
        path.mkdir()
    elif files[name] is not None:
        path.write_text(files[name])
    return str(path)


@pytest.mark.parametrize("name, says", [
    ("missing", "cannot read the routes file (No such file or directory)"),
    ("a folder", "cannot read the routes file"),
    ("not TOML", "not valid TOML"),
    ("a number", "route values must be non-empty strings"),
    ("an empty route", "route values must be non-empty strings"),
    ("a table under an op", "route values must be non-empty strings"),
    ("routes not a table", '"routes" must be a table'),
])
def test_a_bad_routes_file_is_refused_by_info_env_and_enable(runtime, tmp_path, monkeypatch, capsys, name, says):
    path = _routes_file(tmp_path, name)
    monkeypatch.setenv("FLAGGEMS_ROUTES", path)
    problem = config.problems()["FLAGGEMS_ROUTES"]
    assert problem.startswith(f"FLAGGEMS_ROUTES={path}: ") and says in problem
    assert cli.main(["info"]) == 2
    assert f"flaggems: error: {problem}" in capsys.readouterr().err
    assert cli.main(["env"]) == 2
    assert "FLAGGEMS_ROUTES (path, default '') = " in capsys.readouterr().out
    with pytest.raises(ValueError) as raised:
        flaggems.enable()
    assert str(raised.value) == problem and not flaggems.is_enabled()


@pytest.mark.parametrize("text", ['copy_ = "native"\nindex_select = "generic"\n',
                                  '[routes]\ncopy_ = "native"\nindex_select = "generic"\n'])
def test_a_good_routes_file_is_no_problem(tmp_path, monkeypatch, text):
    path = tmp_path / "routes.toml"
    path.write_text(text)
    assert config.read_routes_file(str(path)) == {"copy_": "native", "index_select": "generic"}
    monkeypatch.setenv("FLAGGEMS_ROUTES", str(path))
    assert config.problems() == {}


def test_strict_refuses_an_unmatched_route_and_says_so(runtime, monkeypatch):
    runtime.manager.register(GenericNeg(), "fake-generic")
    monkeypatch.setenv("FLAGGEMS_OP_neg", "bogus")
    with pytest.warns(RuntimeWarning, match="matches no installed implementation .*; using the default chain"):
        flaggems.routes("neg")
    monkeypatch.setenv("FLAGGEMS_STRICT", "1")
    with pytest.raises(PolicyError) as raised:
        flaggems.enable()
    message = str(raised.value)
    assert "route 'bogus' from FLAGGEMS_OP_neg=bogus matches no installed implementation" in message
    assert "FLAGGEMS_STRICT refuses it" in message and "default chain" not in message
    assert not flaggems.is_enabled()


# -- 4. include/exclude: a string is one op name -----------------------------------------------------------
@pytest.mark.parametrize("value, names", [(None, None), ("neg", ("neg",)), (["neg", "abs"], ("neg", "abs")),
                                          (("neg",), ("neg",)), ({"neg"}, ("neg",)), (iter(["abs"]), ("abs",))])
def test_op_names_takes_a_name_or_names(value, names):
    assert op_names(value, "include") == names


@pytest.mark.parametrize("value, says", [(3, "include must be an op name or an iterable of op names, not int"),
                                         (["neg", 3], "include must hold op names (str), got 3 (int)"),
                                         ([b"neg"], "include must hold op names (str), got b'neg' (bytes)")])
def test_op_names_refuses_what_is_no_name(value, says):
    with pytest.raises(TypeError) as raised:
        op_names(value, "include")
    assert str(raised.value) == says


@pytest.fixture
def python_entry(runtime, monkeypatch):
    """The fake generic plugin (neg, abs) enabled through the Python entry (no compiled build needed)."""
    monkeypatch.setenv("FLAGGEMS_ENTRY", "python")
    monkeypatch.setattr(compiled, "_STATE", {})
    runtime.manager.register(GenericNeg(), "fake-generic")
    return runtime


def _chains() -> dict[str, list[str]]:
    return {row["op"]: row["chain"] for row in flaggems.routes()}


def test_a_bare_string_includes_or_excludes_one_op(python_entry):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 'n', 'e', 'g' would each warn: no installed plugin implements them
        flaggems.enable(include="neg")
        assert _chains() == {"abs": ["native"], "neg": ["fake-generic", "native"]}
        assert python_entry.enabled_with == (("neg",), ())
        flaggems.enable(exclude="neg")
        assert _chains() == {"abs": ["fake-generic", "native"], "neg": ["native"]}
        flaggems.disable()
        with flaggems.enabled(include="abs", exclude=()):
            assert _chains() == {"abs": ["fake-generic", "native"], "neg": ["native"]}
        assert not flaggems.is_enabled()
        assert python_entry.compute_routes(include="abs")["neg"].chain == ()
        with flaggems.enabled(include=["neg", "abs"]):  # lists keep working
            assert _chains() == {"abs": ["fake-generic", "native"], "neg": ["fake-generic", "native"]}


@pytest.mark.parametrize("call", [
    lambda: flaggems.enable(include=3),
    lambda: flaggems.enable(exclude=["neg", None]),
    lambda: flaggems.enabled(include=object()).__enter__(),
    lambda: RUNTIME.compute_routes(exclude=7),
])
def test_enable_refuses_include_exclude_that_name_no_op(python_entry, call):
    flaggems.enable(include="neg")
    with pytest.raises(TypeError, match=r"^(include|exclude) must "):
        call()
    assert python_entry.enabled_with == (("neg",), ()), "a refused call leaves the routes as they were"


# -- 5. routes --op: flaggems' own operators by their bare name, aten ones with or without aten:: ----------
class FusedAndAten:
    """A generic plugin routing flaggems::rms_norm (its reference) and neg."""

    @hookimpl
    def flaggems_operators(self, backend):
        return [OpImpl("flaggems::rms_norm", "flaggems.ops:rms_norm"), OpImpl("neg", f"{K}:triton_neg")]


def test_op_candidates():
    assert policy.op_candidates("rms_norm") == ("rms_norm", "flaggems::rms_norm")
    assert policy.op_candidates(" aten::copy_.default ") == ("copy_",)
    assert policy.op_candidates("flaggems::rms_norm") == ("flaggems::rms_norm",)
    assert policy.op_candidates("add.Tensor") == ("add.Tensor", "flaggems::add.Tensor")


def test_routes_finds_a_fused_op_by_its_bare_name(runtime, capsys):
    runtime.manager.register(FusedAndAten(), "fused")
    for name in ("rms_norm", "flaggems::rms_norm", "flaggems::rms_norm.default"):
        assert [row["op"] for row in flaggems.routes(name)] == ["flaggems::rms_norm"], name
    for name in ("neg", "aten::neg", "aten::neg.default"):
        assert [row["op"] for row in flaggems.routes(name)] == ["neg"], name
    assert flaggems.routes("aten::rms_norm") == [], "aten:: names only the aten op"
    assert cli.main(["routes", "--op", "rms_norm"]) == 0
    assert capsys.readouterr().out.startswith("flaggems::rms_norm: fused -> native\n")
    assert cli.main(["routes", "--op", "rms_nrm"]) == 1
    assert "did you mean flaggems::rms_norm?" in capsys.readouterr().err
