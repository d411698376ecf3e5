"""Bad input gets a ScanError naming the leaf and the fix, before work starts where possible."""
import re

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import plain_asserts
from torch_scan_hop import ScanError, scan


def raises(match):
    return pytest.raises(ScanError, match=match)


@pytest.mark.parametrize("grad", [False, True])
def test_carry_shape_change_names_leaf(grad):
    init = {"h": torch.zeros(2, 3, requires_grad=grad), "n": torch.tensor(0)}
    with raises(re.escape("carry['h'] changed across an iteration: shape (2, 6) vs init's (2, 3)")):
        scan(lambda c, x: ({"h": torch.cat([c["h"], c["h"]], -1), "n": c["n"]}, None), init, torch.zeros(2, 1))


def test_carry_dtype_change_names_leaf():
    with raises(re.escape("carry[1] changed across an iteration: dtype torch.float32 vs init's torch.int64")):
        scan(lambda c, x: ((c[0], c[1] * 0.5), None), (torch.zeros(2), torch.tensor(1)), torch.zeros(3, 1))


def test_carry_structure_change_names_missing_leaf():
    with raises(r"different pytree structure than init \(missing: \[\"carry\['b'\]\"\]"):
        scan(lambda c, x: ({"a": c["a"]}, None), {"a": torch.zeros(1), "b": torch.zeros(1)}, torch.zeros(3))


def test_carry_non_tensor_leaf():
    with raises(r"returned carry leaf carry\[1\] is a int 3"):
        scan(lambda c, x: ((c[0], 3), None), (torch.zeros(1), torch.tensor(1)), torch.zeros(2))


def test_init_and_xs_non_tensor_leaves():
    with raises(r"init leaf init\['n'\] is a int 0; every init leaf must be a torch.Tensor"):
        scan(lambda c, x: (c, x), {"n": 0}, torch.zeros(2))
    with raises(r"xs leaf xs\[1\]\[0\] is a float 1.0"):
        scan(lambda c, x: (c, x), torch.zeros(()), (torch.zeros(2), [1.0, 2.0]))


def test_y_non_tensor_leaf():
    with raises(r"y leaf y\['k'\] is a float 1.0"):
        scan(lambda c, x: (c, {"k": 1.0}), torch.zeros(()), torch.zeros(2))


def test_xs_lengths_differ():
    with raises(re.escape("xs leaves have different lengths along dim=0 (xs['a']: 3, xs['b']: 4)")):
        scan(lambda c, x: (c, None), torch.zeros(()), {"a": torch.zeros(3), "b": torch.zeros(4)})


def test_length_disagrees_with_xs():
    with raises("length=5 disagrees with xs, whose leaves have size 3 along dim=0"):
        scan(lambda c, x: (c, None), torch.zeros(()), torch.zeros(3), length=5)


def test_xs_none_without_length():
    with raises("xs is None .* and length is not given; pass length=N"):
        scan(lambda c, x: (c, None), torch.zeros(()))


@pytest.mark.parametrize("bad", [(1, 2, 3), [torch.zeros(1)], torch.zeros(1), None])
def test_fn_not_returning_pair(bad):
    with raises("fn must return a pair \\(new_carry, y\\)"):
        scan(lambda c, x: bad, torch.zeros(1), torch.zeros(2))


def test_dim_out_of_range_names_leaf():
    with raises(re.escape("dim=2 is out of range for xs['b'] with shape (3, 4) (2 dims)")):
        scan(lambda c, x: (c, None), torch.zeros(()), {"a": torch.zeros(3, 4, 5), "b": torch.zeros(3, 4)}, dim=2)
    with raises(re.escape("dim=0 is out of range for xs with shape () (0 dims)")):
        scan(lambda c, x: (c, None), torch.zeros(()), torch.tensor(1.0))


def test_bad_options():
    with raises("fn must be callable"):
        scan(None, torch.zeros(()), torch.zeros(2))
    with raises("remat='everything' is not a policy"):
        scan(lambda c, x: (c, x), torch.zeros(()), torch.zeros(2), remat="everything")
    with raises("length must be a non-negative int"):
        scan(lambda c, x: (c, x), torch.zeros(()), length=-1)
    with raises("unroll must be None or an int >= 1"):
        scan(lambda c, x: (c, x), torch.zeros(()), torch.zeros(2), unroll=0)
    with raises("reverse must be a bool"):
        scan(lambda c, x: (c, x), torch.zeros(()), torch.zeros(2), reverse="yes")


_FRONT_END = {  # name -> a call whose inputs or options the front end refuses, before any trace
    "init_int": lambda x: scan(lambda c, x: (c, x), {"n": 0}, x),
    "xs_float": lambda x: scan(lambda c, x: (c, x), x[0], (x, [1.0, 2.0])),
    "xs_lengths": lambda x: scan(lambda c, x: (c, None), x[0], {"a": x, "b": x[:1]}),
    "length_disagrees": lambda x: scan(lambda c, x: (c, None), x[0], x, length=5),
    "no_xs_no_length": lambda x: scan(lambda c, x: (c, None), x[0]),
    "dim": lambda x: scan(lambda c, x: (c, None), x[0], x, dim=3),
    "fn": lambda x: scan(None, x[0], x),
    "remat": lambda x: scan(lambda c, x: (c, x), x[0], x, remat="everything"),
    "unroll": lambda x: scan(lambda c, x: (c, x), x[0], x, unroll=0),
    "reverse": lambda x: scan(lambda c, x: (c, x), x[0], x, reverse="yes"),
}


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("case", list(_FRONT_END))
def test_front_end_errors_are_scan_errors_under_fullgraph(case, dynamic, fresh_dynamo):
    """Under torch.compile(fullgraph=True) the front end's ScanError (raised by Python that Dynamo
    traces) was Dynamo's Unsupported "Observed exception", our text in its debug context: it is
    now the ScanError, with eager's message (shapes as (?, ?): a size may be symbolic there)."""
    call, x = _FRONT_END[case], torch.zeros(3, 2)
    with pytest.raises(ScanError) as eager:
        call(x)
    with pytest.raises(ScanError) as compiled:
        torch.compile(call, backend="eager", fullgraph=True, dynamic=dynamic)(x)
    first_line = lambda e: str(e.value).splitlines()[0]  # noqa: E731
    assert first_line(compiled) == re.sub(r"shape \(3, 2\)", "shape (?, ?)", first_line(eager))


@pytest.mark.parametrize("option", ["length", "unroll", "dim", "reverse"])
def test_a_tensor_option_is_named_under_torch_compile(option, fresh_dynamo):
    """An option given as a tensor: under fullgraph the ScanError's text used the tensor's repr,
    which Dynamo cannot trace ("Failed to trace builtin operator repr"): the message was lost."""
    kw = {option: torch.tensor(3)}
    xs = None if option == "length" else torch.zeros(2, 1)
    f = torch.compile(lambda c: scan(lambda c, x: (c, c), c, xs, **kw), backend="eager", fullgraph=True)
    with pytest.raises(ScanError, match=rf"{option} must be .*, got a tensor of shape \(\) and dtype torch.int64"):
        f(torch.zeros(()))


def test_y_shape_drift_in_eager():
    with raises("y leaf 0 changed across iterations"):
        scan(lambda c, x: (c + 1, torch.zeros(int(c.item()) + 1)), torch.zeros(()), torch.zeros(3))


def test_carry_error_under_make_fx():
    def f(init, xs):
        return scan(lambda c, x: (c.sum(), x), init, xs)

    with raises(re.escape("carry leaf carry changed across an iteration: shape () vs init's (2,)")):
        make_fx(f, tracing_mode="fake")(torch.zeros(2), torch.zeros(3, 2))


def _routed_rows(c, x):  # a mixture-of-experts router: each expert gathers its tokens (a size from nonzero)
    idx = (x[:, 0] > 0).nonzero().squeeze(-1)
    out = torch.zeros_like(x).index_add(0, idx, torch.tanh(x.index_select(0, idx)))
    return c + out.sum(0), out


def _loop_over_a_tensor(c, x):
    for i in (x[:, 0] > 0).nonzero():
        c = c + x[i[0]]
    return c, c.clone()


def _boolean_mask(c, x):
    return c + x[x > 0].sum(), c.clone()


def _item(c, x):
    return c * x.sum().item(), c.clone()


@pytest.mark.parametrize("body", [_routed_rows, _loop_over_a_tensor, _boolean_mask, _item])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_body_whose_shapes_depend_on_values_is_a_scan_error_under_compile(body, backend, fresh_dynamo):
    """torch 2.15's Dynamo captures .item(), nonzero() and boolean masks in a body with unbacked
    sizes (2.9 breaks the graph there, which was already a ScanError): the scan then failed with an
    InternalTorchDynamoError (PendingUnbackedSymbolNotFound) or a UserError about torch._check,
    which said nothing about the scan. Hugging Face MoE layers (Mixtral, Qwen2-MoE, OLMoE,
    GraniteMoE) under scan_layers hit it. Eager runs it (the loop)."""
    c0, xs = torch.zeros(3), torch.randn(4, 5, 3)
    f = torch.compile(lambda c, xs: scan(body, c, xs), backend=backend, fullgraph=True)
    with raises(r"depend on a tensor's values|captured whole"):
        f(c0, xs)
    want = c0
    for x in xs:
        want, _ = body(want, x)
    torch.testing.assert_close(scan(body, c0, xs)[0], want)


def _split_by_counts(c, x):  # GraniteMoE's experts: the tokens split by per-expert counts from .tolist()
    top = (x[:, 0] > 0).long()
    counts = torch.zeros(2, dtype=torch.long).scatter_add(0, top, torch.ones_like(top)).tolist()
    parts = x.index_select(0, top.argsort()).split(counts)
    return c + parts[0].sum(0) - parts[1].sum(0), c.clone()


@pytest.mark.parametrize("mode", ["make_fx", "compile", "xla"])
def test_sizes_from_tolist_in_the_body_are_a_scan_error(mode, fresh_dynamo):
    """make_fx traced the body (an unbacked size per expert), and the scan failed later with
    "AttributeError: 'SymBool' object has no attribute 'shape'" (a saved symbolic value stacked as
    a y); on XLA, Hugging Face's GraniteMoE failed with a RuntimeError from an ATen kernel."""
    c0, xs = torch.zeros(3, requires_grad=True), torch.randn(4, 5, 3, requires_grad=True)
    with raises(r"data-dependent|depend on a tensor's values|captured whole"):
        if mode == "make_fx":
            make_fx(lambda c, xs: scan(_split_by_counts, c, xs), tracing_mode="fake")(c0, xs)
        elif mode == "compile":
            torch.compile(lambda c, xs: scan(_split_by_counts, c, xs), backend="aot_eager", fullgraph=True)(c0, xs)
        else:
            torch_xla = pytest.importorskip("torch_xla")
            dev = torch_xla.device()
            scan(_split_by_counts, c0.detach().to(dev).requires_grad_(), xs.detach().to(dev).requires_grad_())
    got = scan(_split_by_counts, c0, xs)[0]  # eager: the loop
    want = c0
    for x in xs:
        want, _ = _split_by_counts(want, x)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("where, leaf", [("x", "x leaf 0")])  # a write into a carry works (tests/op/test_inplace.py)
def test_an_in_place_write_to_an_input_names_the_leaf_under_compile(where, leaf, fresh_dynamo):
    """make_fx and export named the mutated leaf; under torch.compile the message was Dynamo's generic
    "Encountered input mutation during higher order op tracing ... Please open an issue"."""
    def body(c, x):
        x.mul_(2)
        return {"a": c["a"] + x, "b": c["b"]}, c["a"].sum()

    init, xs = {"a": torch.zeros(3), "b": torch.zeros(3)}, torch.randn(4, 3)
    f = torch.compile(lambda c, xs: scan(body, c, xs), backend="eager", fullgraph=True)
    with raises(re.escape(f"fn mutates its input in place ({leaf})")):
        f(init, xs)
    with raises(re.escape(f"fn mutates its input in place ({leaf})")):
        make_fx(lambda c, xs: scan(body, c, xs))(init, xs)


def _raises_value_error(c, x):
    raise ValueError("bad leaf 7", 3)


def _mismatched_matmul(c, x):
    return c @ torch.ones(4, 4) + x, c


def _writes_a_saved_view(c, x):  # c[0] * x[0] saves c[0], a view of c, which the assignment then writes
    c = c.clone()
    c[0] = c[0] * x[0]
    return c, c[1:].sum()


BODY_ERRORS = {  # body, whether the inputs need grad, what the ScanError must say
    "raise": (_raises_value_error, False, r"raised ValueError .*: \('bad leaf 7', 3\)$"),
    "op on fake tensors": (_mismatched_matmul, False, r"raised RuntimeError .*\[2, 3\] X \[4, 4\]"),
    # Dynamo named it "Data-dependent assertion failed", or failed printing the empty subgraph for it
    # (InternalTorchDynamoError: IndentationError, torch 2.9 and 2.15)
    "assert": (plain_asserts.asserts_a_shape, False, r"an assert in the body fn failed .*: AssertionError"),
    "assert after an op": (plain_asserts.asserts_after_an_op, False, r"an assert in the body fn failed .*: AssertionError"),
}


@pytest.mark.parametrize("case", list(BODY_ERRORS))
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_body_that_raises_under_compile_is_named_as_such_not_as_a_graph_break(case, backend, fresh_dynamo):
    """Dynamo reports an exception the body raises while it is traced (its own ``raise``, an op
    failing on fake tensors, its gradient failing, an ``assert`` found False) as a graph break; the ScanError said "must be
    captured whole (no graph breaks)", and on torch 2.9 dropped the raised exception's message
    ("Got <class 'torch._dynamo.exc.ObservedValueErrorError'>"). It now names the error and its
    message; eager raises the same error itself."""
    body, grad, message = BODY_ERRORS[case]
    c0, xs = torch.randn(2, 3, requires_grad=grad), torch.randn(5, 2, 3, requires_grad=grad)
    f = torch.compile(lambda c, xs: scan(body, c, xs), backend=backend, fullgraph=True)
    with pytest.raises(ScanError) as info:
        f(c0, xs)
    first = str(info.value).split("\n")[0]
    assert re.search(message, first) and "not a graph break" in first and "captured whole" not in first, first
    with pytest.raises((ValueError, RuntimeError, AssertionError)):  # eager: the body's (or its backward's) own error
        torch.autograd.grad(scan(body, c0, xs)[0].sum(), c0) if grad else scan(body, c0, xs)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_body_whose_backward_fails_under_compile_is_named(backend, fresh_dynamo):
    """Dynamo records the scan node without tracing the body's backward (its example value is made
    below autograd), so a backward that fails fails where it is first traced: AOT's compile (a
    ScanError naming the body, inside the backend's failure) or, with the eager backend, the
    backward itself, as in eager."""
    c0, xs = torch.randn(2, 3, requires_grad=True), torch.randn(5, 2, 3, requires_grad=True)
    f = torch.compile(lambda c, xs: scan(_writes_a_saved_view, c, xs), backend=backend, fullgraph=True)
    if backend == "eager":
        out = f(c0, xs)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            torch.autograd.grad(out[0].sum(), c0)
        return
    with pytest.raises(Exception, match=r"ScanError: torch_scan_hop.scan: the body fn raised RuntimeError when its "
                                        r"joint .*not a graph break.*modified by an inplace operation"):
        f(c0, xs)


_DATA_DEPENDENT_UNDER_SYMBOLIC_MAKE_FX = r'''
import sys, torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch_scan_hop import ScanError, scan

def f(buf, h, xs, W):
    def body(carry, x):
        t, h = carry
        h = torch.tanh(h @ W + x)
        if sys.argv[1] == "indexed write":
            buf[:, t] = h  # a closed-over buffer indexed by a carried step: traced (issue 63)
        elif sys.argv[1] == "python branch":
            if t.item() > 2:  # the guard fails outside any torch function
                h = h * 2
        else:
            h = h + buf[0, 0]
            if h.sum() > 0:
                h = h * 2
        return (t + 1, h), None
    return scan(body, (torch.tensor(0), h), xs)[0]

try:
    make_fx(f, tracing_mode="symbolic")(torch.zeros(2, 5, 3), torch.zeros(2, 3), torch.randn(5, 2, 3), torch.randn(3, 3))
    print("traced")
except ScanError as e:
    print("ScanError:", e)
'''


@pytest.mark.parametrize("case", ["indexed write", "python branch", "tensor branch"])
def test_a_data_dependent_body_under_symbolic_make_fx_is_an_error_not_a_hang(case):
    """make_fx(tracing_mode="symbolic") of a body over closed-over tensors that reads a tensor's
    value NEVER RETURNED: FX prints the failed trace's partial graph into its error, reading
    every node's sizes through the closure stand-ins, which added an ``alias`` node per read to
    the graph being printed. In a child process with a time limit (a hang must fail, not block)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _DATA_DEPENDENT_UNDER_SYMBOLIC_MAKE_FX, case],
                          capture_output=True, text=True, timeout=180)
    if case == "indexed write":  # traced since issue 63: the closed-over buffer is carried, then written
        assert done.stdout.strip() == "traced", done.stdout + done.stderr
        return
    assert "ScanError:" in done.stdout and "depend on a tensor's values" in done.stdout, done.stdout + done.stderr


def test_closure_writes_still_found_once_carried_are_refused_not_retried_forever():
    """A scan carries the closed-over tensors its body writes (trace/closure_writes), and the body
    then writes its carry wherever it names them, through a torch function mode. A write that no
    mode sees (torch._C.DisableTorchFunction) is found again in the retrace: carrying the tensors
    once more would never end (it ran into a RecursionError), so it is a ScanError naming them."""
    def run(c0, xs, buf):
        def body(c, x):
            with torch._C.DisableTorchFunction():
                buf.add_(1)
            return c + x, None
        return scan(body, c0, xs)

    with raises(re.escape("closed-over tensors (shape (4, 3) torch.float32) that this scan already carries")):
        make_fx(run, tracing_mode="fake")(torch.zeros(4, 3), torch.zeros(5, 4, 3), torch.zeros(4, 3))
