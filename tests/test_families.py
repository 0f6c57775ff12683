"""The op families (``flaggems/ops/<family>/``): one folder an op, found without a list, each part where it belongs."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import pytest

import flaggems.plugins.generic as generic
from flaggems import families, ops, testing
from flaggems.testing import random_cases

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = Path(ops.__file__).parent


def test_every_folder_is_a_family_and_holds_only_its_known_parts():
    folders = sorted(p.name for p in FOLDERS.iterdir() if p.is_dir() and not p.name.startswith("__"))
    assert folders == sorted(record.name for record in families.specs())
    known = {"__init__", "spec", *families.PARTS}
    for folder in folders:
        parts = {m.name for m in pkgutil.iter_modules([str(FOLDERS / folder)])}
        assert parts <= known, f"ops/{folder} holds {sorted(parts - known)}: not a part of an op family"


def test_every_op_belongs_to_one_family_with_its_cases_and_generator():
    owners: dict[str, str] = {}
    for record in families.specs():
        for op in record.ops:
            assert op not in owners, f"{op} in two families: {owners.get(op)} and {record.name}"
            owners[op] = record.name
    served = {impl.op for impl in generic.OPERATORS}
    assert served <= set(owners), f"generic ops of no family: {sorted(served - set(owners))}"
    for op in owners:
        assert testing.cases_for(op), f"{op}: no contract cases"
        assert op in random_cases.GENERATORS, f"{op}: no random case generator"
    defined = {f"flaggems::{name}" for name in families.defined()}
    assert defined == {op for op in owners if op.startswith("flaggems::")}


def test_every_part_imports_and_declares_what_its_reader_reads():
    for record in families.specs():
        for part, name in (("reference", "DEFINED"), ("cases", "CASES"), ("generate", "GENERATORS"),
                           ("shapes", "WORKLOADS"), ("policy", "POLICIES"), ("patch", "RULES")):
            module = record.part(part)
            if module is not None:
                assert hasattr(module, name), f"{record.package}.{part} declares no {name}"
        assert all(importlib.util.find_spec(front) for front in record.fronts)


@pytest.fixture
def scratch_folder(tmp_path):
    """A folder appended to ``flaggems.ops``' search path; removed and the families found again after."""
    ops.__path__.append(str(tmp_path))
    yield tmp_path
    ops.__path__.remove(str(tmp_path))
    families.forget_specs()


def test_a_spec_naming_another_family_than_its_folder_is_refused(scratch_folder):
    (scratch_folder / "odd_family").mkdir()
    (scratch_folder / "odd_family" / "__init__.py").write_text("")
    (scratch_folder / "odd_family" / "spec.py").write_text(
        "from flaggems.families import OpSpec\nSPEC = OpSpec(name='other', ops=('neg',))\n")
    families.forget_specs()
    with pytest.raises(ValueError, match="names its family 'other', not its folder's name"):
        families.specs()


def test_a_family_declaring_cases_of_an_op_outside_it_is_refused(scratch_folder, monkeypatch):
    folder = scratch_folder / "stray_cases"
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    (folder / "spec.py").write_text(
        "from flaggems.families import OpSpec\nSPEC = OpSpec(name='stray_cases', ops=('neg',))\n")
    (folder / "cases.py").write_text("CASES = {'sin': []}\n")
    families.forget_specs()
    monkeypatch.setattr(testing, "_LOADED", False)
    monkeypatch.setattr(testing, "_CASES", dict(testing._CASES))
    with pytest.raises(ValueError, match="stray_cases"):
        testing.cases_for("neg")


def test_no_source_file_is_over_a_thousand_lines():
    roots = ("core", "plugins", "flaggems_ascend", "flaggems_kunlunxin", "flaggems_hygon", "benchmarks", "tools",
             "tests", "examples")
    long = [(str(p.relative_to(ROOT)), n) for root in roots for p in (ROOT / root).rglob("*")
            if p.suffix in (".py", ".cpp", ".inc", ".sh") and ".tox" not in p.parts
            and (n := len(p.read_text().splitlines())) > 1000]
    assert long == []
