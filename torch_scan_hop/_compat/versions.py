"""The torch versions this package supports, as data: the one place that states the range.

``pyproject.toml``'s dependency, the package's warnings and the README / docs lines that
name the range all say what is written here (``tests/arch/test_versions.py`` checks them).
Widening the range (``docs/contributing.md``, "a new torch version") changes ``NEWEST``
here, the dependency and the lines that test names.
"""
OLDEST = (2, 9)  # the oldest torch the suite runs on
NEWEST = (2, 15)  # the newest (CI's "Another torch" run)


def _dotted(version):
    return ".".join(str(part) for part in version)


def requirement():
    """The pip requirement, as ``pyproject.toml`` declares it: ``torch>=2.9,<2.16``."""
    above = (NEWEST[0], NEWEST[1] + 1)
    return f"torch>={_dotted(OLDEST)},<{_dotted(above)}"


def supported_range():
    """The range in words, as messages and docs name it: ``torch 2.9 to 2.15``."""
    return f"torch {_dotted(OLDEST)} to {_dotted(NEWEST)}"

