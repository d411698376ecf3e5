"""No whole-buffer copies around the While that a layer stack's training step runs on XLA.

A layer stack saves each layer's input for the backward: a y that is the step's
carry input. Written from that input, the row write read the old carry after the
body had made the new one, and XLA copied the carry in every iteration to keep
it; it is now written from the step's carry output into the next step's row
(csrc/hlo_scan.cc, "carried"). The stacked ys buffers started as equal zero
broadcasts, which XLA merged into one and then copied for each other buffer: a
read and a write of a whole stacked buffer per scan; each now starts from its
own value (``xla/lower.py``, ``_fill``). These read the OPTIMIZED HLO XLA
compiled (its dump, in a child interpreter started with XLA_FLAGS, see
_isolated.py) and check values and gradients against the Python loop, including
the wrap-around write of the carried rows (every length, order and unroll).
With ``unroll`` covering every layer the step has no While and no stacked buffer
at all (csrc/hlo_straight.h): each saved activation and each gradient row reaches
its reader directly, as in the Python loop's graph. A saved carry input that the
step before's saved values rebuild (a layer's input is GELU of the previous
pre-activation) is not stacked at all (trace/shift.py): one fill fewer.
"""
import glob
import os
import re
import shutil
import tempfile

import pytest

pytest.importorskip("torch_xla", reason="torch_xla is not installed: the XLA tests need the [xla] extra (torch 2.9)")
import _isolated  # noqa: E402
from test_xla_stacking import computations  # noqa: E402

DEPTH, ROWS, WIDTH = 3, 64, 16
_DUMP = os.path.join(tempfile.gettempdir(), f"scan_saved_dump_{os.getpid()}")
_ENV = {"XLA_FLAGS": f"--xla_dump_to={_DUMP} --xla_dump_hlo_as_text"}


@pytest.fixture(scope="module", autouse=True)
def _remove_dump():
    yield
    shutil.rmtree(_DUMP, ignore_errors=True)


def copies(text, stacked):
    """'computation: instruction = shape' for each copy of an array (not a scalar) inside a
    While body, and each copy of a ``stacked``-shaped buffer anywhere."""
    comps, bodies = computations(text)
    found = []
    for comp, instructions in comps.items():
        for name, shape, opcode in instructions:
            if opcode != "copy" or not re.fullmatch(r"\w+\[[\d,]+\]", shape):
                continue
            if comp in bodies or shape == stacked:
                found.append(f"{comp}: {name} = {shape}")
    return found


def test_the_check_finds_a_carry_copy_and_a_buffer_copy():
    text = """HloModule m

%loop.1 (state: (s64[], f32[64,16], f32[3,64,16])) -> (s64[], f32[64,16], f32[3,64,16]) {
  %state = (s64[], f32[64,16]{1,0}, f32[3,64,16]{2,1,0}) parameter(0)
  %i = s64[] get-tuple-element(%state), index=0
  %c = f32[64,16]{1,0} get-tuple-element(%state), index=1
  %copy.8 = s64[] copy(%i)
  %copy.9 = f32[64,16]{1,0} copy(%c)
  ROOT %t = (s64[], f32[64,16]{1,0}, f32[3,64,16]{2,1,0}) tuple(%copy.8, %copy.9, %ys)
}

ENTRY %main (p: f32[64,16]) -> f32[3,64,16] {
  %p = f32[64,16]{1,0} parameter(0)
  %x = f32[64,16]{1,0} copy(%p)
  %zeros = f32[3,64,16]{2,1,0} broadcast(%zero), dimensions={}
  %copy.7 = f32[3,64,16]{2,1,0} copy(%zeros)
  ROOT %w = (s64[], f32[64,16]{1,0}, f32[3,64,16]{2,1,0}) while(%init), condition=%cond, body=%loop.1
}
"""
    assert copies(text, "f32[3,64,16]") == ["loop.1: copy.9 = f32[64,16]", "main: copy.7 = f32[3,64,16]"]


def _dump_folder():
    return re.search(r"--xla_dump_to=(\S+)", os.environ.get("XLA_FLAGS", "")).group(1)  # the parent's _DUMP


def _optimized_modules(dump):
    texts = []
    for path in glob.glob(os.path.join(dump, "*cpu_after_optimizations.txt")):
        with open(path) as f:
            texts.append(f.read())
    return texts


def _layer_stack_training_step(rows, unroll):
    """In the child: ``step(stacked)``, one training step of a GELU layer stack on XLA (the loop's,
    or scan_layers' with ``unroll``), returning its output and gradients on the CPU."""
    import torch
    import torch_xla

    from torch_scan_hop import scan_layers

    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU())
                                 for _ in range(DEPTH)).to(torch_xla.device())
    x = torch.randn(rows, WIDTH).to(torch_xla.device())

    def step(stacked):
        layers.zero_grad(set_to_none=True)
        h = x
        if stacked:
            h = scan_layers(layers, h, unroll=unroll)
        else:
            for layer in layers:
                h = layer(h)
        h.pow(2).mean().backward()
        torch_xla.sync()
        return h.cpu(), [p.grad.cpu() for p in layers.parameters()]

    return step


def check_layer_stack():
    """In the child: a scan_layers training step == the loop's; then read the optimized HLO."""
    from conftest import assert_trees_close

    dump = _dump_folder()
    shutil.rmtree(dump, ignore_errors=True)
    step = _layer_stack_training_step(ROWS, unroll=None)  # the default: one While
    assert_trees_close(step(True), step(False), atol=1e-6, rtol=1e-5)
    texts = _optimized_modules(dump)
    scans = [t for t in texts if "scan_loop" in t]
    assert scans, f"no optimized module with a scan While in {dump} (is XLA_FLAGS honoured?)"
    found = [line for t in scans for line in copies(t, f"f32[{DEPTH},{ROWS},{WIDTH}]")]
    assert not found, "whole-buffer copies in or around the layer stack's While:\n" + "\n".join(found)


def test_layer_stack_step_copies_no_carry_and_no_stacked_buffer():
    _isolated.call("test_xla_saved_buffers", "check_layer_stack", env=_ENV)


def stacked_values(text, rows):
    """Each While, and each instruction of a layer-stacked shape (a saved activation, a weight or
    bias or their gradients stacked over the layers), in an optimized HLO module's text."""
    stacked = {f"f32[{DEPTH},{rows},{WIDTH}]", f"f32[{DEPTH},{WIDTH},{WIDTH}]", f"f32[{DEPTH},{WIDTH}]"}
    comps, _ = computations(text)
    return [f"{comp}: {name} = {shape} {opcode}" for comp, instructions in comps.items()
            for name, shape, opcode in instructions if opcode == "while" or shape in stacked]


def check_straight_layer_stack(unroll, rows):
    """In the child: scan_layers(..., unroll=unroll) training steps == the loop's, and nothing in
    their optimized HLO is a While or stacked over the layers. Each case its own ``rows``: torch_xla
    would reuse the other's compiled graph, and XLA dump nothing."""
    from conftest import assert_trees_close

    dump = _dump_folder()
    step = _layer_stack_training_step(rows, unroll)
    want = step(False)
    shutil.rmtree(dump, ignore_errors=True)  # from here on the dump holds the scanned steps' programs
    for _ in range(3):  # a training call: Dynamo's capture at once, then calls on its guards (one program)
        assert_trees_close(step(True), want, atol=1e-6, rtol=1e-5)
    texts = _optimized_modules(dump)
    assert texts, f"no optimized module in {dump} (is XLA_FLAGS honoured?)"
    found = [line for t in texts for line in stacked_values(t, rows)]
    assert not found, "a While or a layer-stacked buffer in the straight-line step:\n" + "\n".join(found)


@pytest.mark.parametrize("unroll, rows", [(DEPTH, ROWS), (2 * DEPTH, ROWS // 2)], ids=["unroll_depth", "unroll_more"])
def test_straight_layer_stack_step_stacks_nothing(unroll, rows):  # unroll >= the depth: straight-line
    _isolated.call("test_xla_saved_buffers", "check_straight_layer_stack", unroll, rows, env=_ENV)


@pytest.mark.parametrize("length", [1, 2, 5])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("unroll", [1, 2, 3])
def test_saved_carry_rows_match_the_loop(length, reverse, unroll):
    """ys that are the step's carry input (twice, and beside another y): rows written into the
    next step's row, wrapping around, then the first step's row from the initial carry."""
    import torch
    from xla_util import assert_matches_loop

    g = torch.Generator().manual_seed(length + 10 * unroll + 100 * reverse)
    w, xs = torch.randn(8, 8, generator=g) * 0.5, torch.randn(length, 4, 8, generator=g)

    def make_body(w):
        def body(c, x):
            new = torch.tanh(c @ w + x)
            return new, (c, new * 2, c)
        return body

    assert_matches_loop(make_body, [w], torch.randn(4, 8, generator=g), xs, grad=True, reverse=reverse,
                        unroll=unroll)


def check_one_activation_stack(shift):
    """In the child: a GELU layer stack saves each layer's input (for its weight gradient) and its
    pre-activation (for GELU's); the input of layer i is GELU of layer i-1's pre-activation, so the
    backward rebuilds it and the forward fills and writes one [depth, rows, width] buffer, not two
    (trace/shift.py). ``shift=False`` patches that off: the check sees the two it finds then."""
    import torch_scan_hop.trace.shift as shift_module
    from conftest import assert_trees_close

    if not shift:
        shift_module.use_shift = lambda *args: False
    dump = _dump_folder()
    shutil.rmtree(dump, ignore_errors=True)
    rows = ROWS + 8 * shift  # a graph of its own per case: torch_xla would reuse the other's
    step = _layer_stack_training_step(rows, unroll=1)
    assert_trees_close(step(True), step(False), atol=1e-6, rtol=1e-5)
    stacked = f"f32[{DEPTH},{rows},{WIDTH}]"
    fills = [f"{comp}: {name}" for t in _optimized_modules(dump) if "scan_loop" in t
             for comp, instructions in computations(t)[0].items()
             for name, shape, opcode in instructions if opcode == "broadcast" and shape == stacked]
    assert len(fills) == (1 if shift else 2), f"fills of stacked activations: {fills}"


@pytest.mark.parametrize("shift", [True, False], ids=["rebuilt", "patched_off"])
def test_layer_stack_fills_one_activation_stack(shift):
    _isolated.call("test_xla_saved_buffers", "check_one_activation_stack", shift, env=_ENV)


def _shift_bodies():
    """Bodies whose saved carry input the backward rebuilds from the step before (and one it
    cannot): (make_body, closures, init, xs) with small random tensors; carries of 4 x 64 float32
    rows, 1 KiB (smaller ones keep their stack: ``shift.worth_it``); weights scaled by 1/sqrt(W)."""
    import torch

    F = torch.nn.functional
    W = 64
    g = torch.Generator().manual_seed(7)
    rand = lambda *shape: torch.randn(*shape, generator=g) * 0.5  # noqa: E731

    def gelu_layers():
        return lambda: lambda h, x: (F.gelu(F.linear(h, x[0], x[1])), h.sum(-1)), [], rand(4, W), \
            lambda n: (rand(n, W, W) / 8, rand(n, W))

    def two_carries(s, w):  # c: sigmoid * closure, through views; d: residual, stays stacked
        def body(carry, x):
            c, d = carry
            c2 = (torch.sigmoid(c @ w + x) * s).reshape(W, 4).t().reshape(4, W)
            return (c2, d + torch.sin(d @ w)), c2.sum(-1) + d.sum(-1)
        return body

    return {
        "gelu_layers": gelu_layers(),
        "tanh_rnn": (lambda w: lambda c, x: (torch.tanh(c @ w + x), (c, c * 2)), [rand(W, W) / 8], rand(4, W),
                     lambda n: rand(n, 4, W)),
        "two_carries": (two_carries, [rand(W), rand(W, W) / 8], (rand(4, W), rand(4, W)), lambda n: rand(n, 4, W)),
    }


# every body at every length forward and reversed, unrolled and not: (False, 1) with (True, 2) at lengths
# 1 and 3, (True, 1) with (False, 2) at 2 and 5 (all four pairs at every length took ~90 s of a CI run)
@pytest.mark.parametrize("name", ["gelu_layers", "tanh_rnn", "two_carries"])
@pytest.mark.parametrize("length,reverse,unroll", [(n, r != (k % 2 == 1), u) for k, n in enumerate([1, 2, 3, 5])
                                                   for r, u in ((False, 1), (True, 2))])
def test_rebuilt_carries_match_the_loop(name, length, reverse, unroll):
    """Values and gradients (closures, init, xs) with the saved carries rebuilt: the first step's
    from the init, the others' from the step before, in either order, unrolled or not."""
    from xla_util import assert_matches_loop

    make_body, closures, init, xs = _shift_bodies()[name]
    assert_matches_loop(make_body, closures, init, xs(length), grad=True, reverse=reverse, unroll=unroll)


@pytest.mark.parametrize("name", ["gelu_layers", "tanh_rnn", "two_carries", "small_rows"])
def test_each_body_rebuilds_its_carry(name, monkeypatch):
    """The cases above do take the rebuilt path (a fresh plan, the backward's builder watched);
    rows under 1 KiB keep their stack (``shift.worth_it``)."""
    import torch

    import torch_scan_hop.trace.shift as shift
    from torch_scan_hop.trace import cache
    from xla_util import assert_matches_loop

    rebuilt = []
    real = shift.rebuild_carries
    monkeypatch.setattr(shift, "rebuild_carries", lambda graph, shifts, *a: rebuilt.append(shifts) or real(graph, shifts, *a))
    cache.clear()
    if name == "small_rows":
        make_body, closures, init, xs = (lambda w: lambda c, x: (torch.tanh(c @ w + x), c.sum(-1)),
                                         [torch.randn(8, 8) / 3], torch.randn(4, 8), lambda n: torch.randn(n, 4, 8))
    else:
        make_body, closures, init, xs = _shift_bodies()[name]
    assert_matches_loop(make_body, closures, init, xs(3), grad=True)
    assert bool(rebuilt) == (name != "small_rows")  # Dynamo's fake run and the XLA run may both plan


def test_rebuilt_carry_under_the_openxla_backend(monkeypatch):
    """torch.compile(backend="openxla") traces the same rule on fake XLA tensors: the rebuilt
    carry's backward is traced into its graph and gives the loop's value and gradient."""
    import torch

    import torch_scan_hop.trace.shift as shift
    from torch_scan_hop import scan
    from xla_util import assert_openxla_matches_eager

    rebuilt = []
    real = shift.rebuild_carries
    monkeypatch.setattr(shift, "rebuild_carries", lambda graph, shifts, *a: rebuilt.append(1) or real(graph, shifts, *a))
    torch.manual_seed(4)
    w_cpu = (torch.randn(64, 64) / 8).requires_grad_()

    def loss(w, c0, xs):
        c, ys = scan(lambda c, x: (torch.nn.functional.gelu(c @ w + x), c.sum(-1)), c0, xs, reverse=True)
        return c.sum() + ys.sum()

    assert_openxla_matches_eager(loss, w_cpu, torch.zeros(4, 64), torch.randn(6, 4, 64))
    assert rebuilt
