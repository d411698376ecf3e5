"""Stacked values are written in place on XLA: a step's cost does not grow with the length.

A scan stacks its ys, and in training the forward stacks the residuals the
backward reads and the backward stacks the xs gradients. Inside a While, any
instruction that produces a whole stacked buffer costs O(length) per step, so
O(length^2) per scan: a copy XLA inserts when the buffer cannot be aliased, or
a dynamic-update-slice fused with the row's producer (XLA CPU's loop-fusion
emitter then writes every element of the buffer, not the row). This reads the
OPTIMIZED HLO XLA compiled (its dump, in a child interpreter started with
XLA_FLAGS, see _isolated.py) and fails on any instruction in a While body whose
result has at least ``LENGTH`` elements other than a lone dynamic-update-slice
and the free ones (parameter, get-tuple-element, tuple, bitcast). Every
per-step value here is smaller than ``LENGTH``, so only stacked buffers can be
that big. Values are checked against the Python loop too.

A y whose row has at least 4 * length elements (a layer stack's activations)
is written at once by a fused update instead (csrc/hlo_scan.cc, "stacked ys"):
``test_rows_written_at_once_and_delayed_together`` checks its values.
"""
import glob
import os
import re
import shutil
import tempfile

import pytest

pytest.importorskip("torch_xla", reason="torch_xla is not installed: the XLA tests need the [xla] extra (torch 2.9)")
import _isolated  # noqa: E402

LENGTH, BATCH, HIDDEN = 37, 2, 3  # per-step values: at most BATCH * HIDDEN * 2 = 12 elements
_FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "dynamic-update-slice"}
_DUMP = os.path.join(tempfile.gettempdir(), f"scan_stacking_dump_{os.getpid()}")
_ENV = {"XLA_FLAGS": f"--xla_dump_to={_DUMP} --xla_dump_hlo_as_text"}



@pytest.fixture(scope="module", autouse=True)
def _remove_dump():
    yield
    shutil.rmtree(_DUMP, ignore_errors=True)


_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.-]+) .*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.-]+) = (\S+?)(?:\{[^}]*\})? ([\w-]+)\(")
_WHILE_BODY = re.compile(r"\bwhile\(.*\bbody=%([\w.-]+)")


def computations(text):
    """{name: [(instruction, result shape, opcode)]} and the set of While bodies in an HLO module's text."""
    comps, bodies, current = {}, set(), None
    for line in text.splitlines():
        head = _COMPUTATION.match(line)
        if head:
            current = comps.setdefault(head.group(1), [])
            continue
        inst = _INSTRUCTION.match(line)
        if inst and current is not None:
            current.append(inst.groups())
        body = _WHILE_BODY.search(line)
        if body:
            bodies.add(body.group(1))
    return comps, bodies


def elements(shape):
    """Elements of an array shape text (f32[37,2]); None for tuples and tokens."""
    match = re.fullmatch(r"\w+\[([\d,]*)\]", shape)
    if not match:
        return None
    n = 1
    for d in filter(None, match.group(1).split(",")):
        n *= int(d)
    return n


def optimized_scans(dump):
    """The texts of the optimized modules in ``dump`` that hold a scan's While (at least one)."""
    texts = []
    for path in glob.glob(os.path.join(dump, "*cpu_after_optimizations.txt")):
        with open(path) as f:
            texts.append(f.read())
    scans = [t for t in texts if "scan_loop" in t]
    assert scans, f"no optimized module with a scan While in {dump} (is XLA_FLAGS honoured?)"
    return scans


def stacked_writes_in_loops(text, length):
    """'body: instruction = shape opcode' for each instruction of a While body that makes a stacked-size buffer."""
    comps, bodies = computations(text)
    found = []
    for body in sorted(bodies):
        for name, shape, opcode in comps.get(body, []):
            size = elements(shape)
            if size is not None and size >= length and opcode not in _FREE:
                found.append(f"{body}: {name} = {shape} {opcode}")
    return found


def check_stacking(case, reverse, unroll):
    """In the child: run ``case`` on XLA, compare with the loop, then read the optimized HLO."""
    import torch
    from xla_util import assert_matches_loop

    dump = re.search(r"--xla_dump_to=(\S+)", os.environ.get("XLA_FLAGS", "")).group(1)  # the parent's _DUMP
    shutil.rmtree(dump, ignore_errors=True)
    g = torch.Generator().manual_seed(LENGTH + 7 * unroll + reverse)
    w = torch.randn(HIDDEN, HIDDEN, generator=g) * 0.5
    init, xs = torch.zeros(BATCH, HIDDEN), torch.randn(LENGTH, BATCH, HIDDEN, generator=g)

    def make_body(w):
        def body(c, x):
            c = torch.tanh(c @ w + x)
            if case == "fwd_no_ys":
                return c, None
            return c, (c.sum(-1), c * 2)  # a row per step and a 2-d block per step
        return body

    assert_matches_loop(make_body, [w], init, xs, grad=case == "train", reverse=reverse, unroll=unroll)
    import torch_xla

    torch_xla.sync()
    found = [line for t in optimized_scans(dump) for line in stacked_writes_in_loops(t, LENGTH)]
    assert not found, "instructions that write a whole stacked buffer inside a While body:\n" + "\n".join(found)


def test_the_check_finds_a_fused_update_and_a_copy():
    text = """HloModule m

%fused (p0: f32[37,2], p1: f32[1,2], p2: s64[]) -> f32[37,2] {
  ROOT %dus = f32[37,2]{1,0} dynamic-update-slice(%p0, %p1, %p2, %p2)
}

%loop.1 (state: (s64[], f32[37,2])) -> (s64[], f32[37,2]) {
  %state = (s64[], f32[37,2]{1,0}) parameter(0)
  %ys = f32[37,2]{1,0} get-tuple-element(%state), index=1
  %copy.3 = f32[37,2]{1,0} copy(%ys)
  %dus_fusion = f32[37,2]{1,0} fusion(%copy.3, %row, %i), kind=kLoop, calls=%fused
  %small = f32[1,2]{1,0} copy(%row)
  ROOT %t = (s64[], f32[37,2]{1,0}) tuple(%i, %dus_fusion)
}

ENTRY %main (p: (s64[], f32[37,2])) -> (s64[], f32[37,2]) {
  %p = (s64[], f32[37,2]{1,0}) parameter(0)
  ROOT %w = (s64[], f32[37,2]{1,0}) while(%p), condition=%cond, body=%loop.1
}
"""
    assert stacked_writes_in_loops(text, 37) == [
        "loop.1: copy.3 = f32[37,2] copy", "loop.1: dus_fusion = f32[37,2] fusion"]
    in_place = text.replace("%copy.3 = f32[37,2]{1,0} copy(%ys)", "").replace(
        "fusion(%copy.3, %row, %i), kind=kLoop, calls=%fused", "dynamic-update-slice(%ys, %row, %i, %i)")
    assert stacked_writes_in_loops(in_place, 37) == []


@pytest.mark.parametrize("case", ["fwd", "fwd_no_ys", "train"])
@pytest.mark.parametrize("reverse", [False, True])
def test_no_stacked_buffer_written_whole_inside_the_loop(case, reverse):
    _isolated.call("test_xla_stacking", "check_stacking", case, reverse, 1, env=_ENV)


@pytest.mark.parametrize("reverse", [False, True])
def test_no_stacked_buffer_written_whole_with_unroll(reverse):
    """unroll=2 over 37 steps: a block of two rows per iteration, then a remainder While."""
    _isolated.call("test_xla_stacking", "check_stacking", "train", reverse, 2, env=_ENV)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("unroll", [1, 2])
def test_rows_written_at_once_and_delayed_together(reverse, unroll):
    """Length 3: a 12-element row (written at once) beside a 2-element one (delayed), values and grads."""
    import torch
    from xla_util import assert_matches_loop

    g = torch.Generator().manual_seed(3 + unroll + 5 * reverse)
    w, xs = torch.randn(6, 6, generator=g) * 0.5, torch.randn(3, 2, 6, generator=g)

    def make_body(w):
        def body(c, x):
            c = torch.tanh(c @ w + x)
            return c, (c, c.sum(-1))
        return body

    assert_matches_loop(make_body, [w], torch.zeros(2, 6), xs, grad=True, reverse=reverse, unroll=unroll)
