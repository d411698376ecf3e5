"""XLA: what a body may create or read.

Tensors the body creates become constants of the While, moves to the CPU
keep the value on the device, and a host read inside the body is a ScanError
naming the op, raised before anything could abort the process.
"""
import re

import pytest
import xla_isolated_cases
from xla_util import run_isolated


@pytest.fixture(scope="module")
def isolated_report():
    """{case name: output} from one subprocess running every case; a case
    that killed the process has the crash output and no PASS line."""
    rc, out = run_isolated("import xla_isolated_cases; xla_isolated_cases.main()", timeout=900)
    report = {}
    for block in re.split(r"(?m)^START ", out)[1:]:
        name, _, rest = block.partition("\n")
        report[name.strip()] = rest
    return rc, out, report


@pytest.mark.parametrize("name", [c.__name__ for c in xla_isolated_cases.CASES])
def test_in_a_subprocess(isolated_report, name):
    rc, out, report = isolated_report
    assert name in report, f"never reached (exit code {rc}):\n{out[-3000:]}"
    assert f"PASS {name}" in report[name], f"exit code {rc}:\n{report[name][-3000:]}"
