"""The supported torch range is stated once (``_compat/versions.py``); everything that names it agrees.

A range widened in one place and not another (the dependency says 2.16, a warning still says 2.14)
tells users the wrong thing, so the package's docstrings and messages, the README and docs/ may
name the supported range only in the one wording ``versions.supported_range()`` gives, and
``pyproject.toml``'s dependency must be ``versions.requirement()``.
"""
import pathlib
import re

from torch_scan_hop._compat import versions

ROOT = pathlib.Path(__file__).resolve().parents[2]  # tests/arch/ -> the repository
# "2.9-2.14", "2.9 to 2.14", "2.9 - 2.15", "2.9..2.15", "2.9 through 2.16", "2.9–2.15"
RANGE = re.compile(r"(?<![\d.])(\d+)\.(\d+)\s*(?:-|–|to|through|\.\.)\s*(\d+)\.(\d+)(?![\d.])")
# Files another engineer is editing now (issue 61): their ranges are reworded with their change.
# Remove an entry once its file passes; the test fails on an entry that already passes.
PENDING = set()


def _texts():
    """Every file whose text users read as a statement of the range: the package, README, docs/."""
    yield from sorted(ROOT.glob("torch_scan_hop/**/*.py"))
    yield ROOT / "README.md"
    yield from sorted(ROOT.glob("docs/*.md"))


def names_another_range(line):
    """The ranges in ``line`` that read as the supported one (from the oldest supported torch to
    about the newest) in a wording other than ``versions.supported_range()``. A defect's range
    ("torch 2.9-2.11 misread ...") ends well before the newest torch and is not a claim of support."""
    wrong = []
    for found in RANGE.finditer(line):
        start, end = (int(found.group(1)), int(found.group(2))), (int(found.group(3)), int(found.group(4)))
        if start != versions.OLDEST or end[0] != start[0] or end < (versions.NEWEST[0], versions.NEWEST[1] - 1):
            continue  # not from the oldest torch, a table's numbers (2.9-3.1), or a defect's range
        if f"torch {found.group(0)}" not in versions.supported_range() or end != versions.NEWEST:
            wrong.append(found.group(0))
    return wrong


def _offenders():
    out = {}
    for path in _texts():
        rel = str(path.relative_to(ROOT))
        for number, line in enumerate(path.read_text().splitlines(), 1):
            wrong = names_another_range(line)
            if wrong:
                out.setdefault(rel, []).append(f"{number}: {wrong}")
    return out


def test_the_range_is_named_in_one_wording():
    offenders = {path: lines for path, lines in _offenders().items() if path not in PENDING}
    assert offenders == {}, f"say {versions.supported_range()!r} (torch_scan_hop/_compat/versions.py): {offenders}"


def test_pending_files_still_need_their_rewording():
    """An entry of PENDING whose file now passes is dropped from it, so that the file stays checked
    (a file moved away needs nothing: its new place is checked as any other)."""
    assert sorted(p for p in PENDING - set(_offenders()) if (ROOT / p).exists()) == []


def test_the_pattern_tells_the_range_from_a_defects_range():
    newest = ".".join(map(str, versions.NEWEST))
    before = f"{versions.NEWEST[0]}.{versions.NEWEST[1] - 1}"
    assert names_another_range(f"supports torch 2.9-{before} and more") == [f"2.9-{before}"]
    assert names_another_range(f"torch 2.9 to {before}") == [f"2.9 to {before}"]
    assert names_another_range(f"torch 2.9-{newest}: the same API") == [f"2.9-{newest}"]
    assert names_another_range(f"torch 2.9 to {newest}: the same API") == []
    assert names_another_range("torch 2.9-2.11 misread strided rows") == []
    assert names_another_range("torch 2.10-2.11") == []
    assert names_another_range("| 2.9-3.1 ms |") == []


def test_the_dependency_is_the_one_range():
    pyproject = (ROOT / "pyproject.toml").read_text()
    declared = re.search(r'^dependencies = \["(torch[^"]*)"\]', pyproject, re.M)
    assert declared is not None and declared.group(1) == versions.requirement()


def test_the_range_formats_as_pip_and_prose_say_it():
    assert versions.requirement() == "torch>=2.9,<2.16"
    assert versions.supported_range() == "torch 2.9 to 2.15"
