"""A scan whose body is pointwise in its carries runs on CUDA as ONE Triton kernel with the time loop inside
(``inductor/pointwise_scan``, ``inductor/codegen/triton_scan``), forward and backward.

Without a GPU: the generated source runs on the CPU under Triton's interpreter, in a child
interpreter started with ``TRITON_INTERPRET=1`` (``pointwise_scan_cases``), against the Python loop
(float32 and float64, both directions, several carries and ys, broadcast x rows and closed-over
tensors, non-contiguous inputs, Mamba's body with its y a sum over the state dim and C_t placed by
its view), also compiled end to end with the pass allowed on CPU tensors there;
the same sources compiled by Triton for an sm_90 GPU (PTX and cubin, no GPU needed);
and the pass's decisions on graphs of fake CUDA tensors (applied to pointwise bodies; a matmul, a
reduction, an integer carry, mixed shapes, no steps, CPU tensors left exactly as they were). With a
GPU: forward and training step compiled as users run them.
"""
import _isolated
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from torch_scan_hop import scan
from torch_scan_hop.inductor import pointwise_scan
from torch_scan_hop.inductor.codegen import pass_counts, passes_off, reset_pass_counts

pytest.importorskip("triton")
INTERPRET = {"TRITON_INTERPRET": "1", pointwise_scan.ENV: "1"}


@pytest.fixture(autouse=True)
def _kernels_on():
    """The pass is opt-in (``kernels_enabled``): on for this file's in-process checks."""
    with pointwise_scan.kernels_enabled():
        yield
SCAN = torch.ops.higher_order.scan
OP = torch.ops.torch_scan_hop.pointwise_scan.default
CASES = ["linear", "rglru", "wkv", "mixed", "mamba"]


def _interpreted(func, *args):
    _isolated.call("pointwise_scan_cases", func, *args, env=INTERPRET)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("reverse", [False, True])
def test_generated_kernel_gives_the_loops_values(case, dtype, reverse):
    _interpreted("check_generator", case, dtype, reverse)


def test_generated_kernel_reads_inputs_by_their_strides():
    _interpreted("check_generator", "mixed", "float64", True, True)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype,reverse", [("float32", True), ("bfloat16", False), ("float64", False)])
def test_generated_kernel_compiles_for_a_cuda_gpu(case, dtype, reverse):
    """Triton's compiler (to PTX and ptxas's cubin) runs without a GPU: a child without the interpreter."""
    _isolated.call("pointwise_scan_cases", "check_compiles_for_cuda", case, dtype, reverse)


@pytest.mark.parametrize("case,reverse", [("linear", False), ("rglru", True), ("wkv", False), ("mixed", True),
                                          ("mamba", False), ("mamba", True)])
def test_compiled_training_step_runs_both_scans_as_kernels(case, reverse):
    _interpreted("check_compiled", case, reverse)


@pytest.mark.parametrize("case,reverse", [("rglru", False), ("wkv", False), ("mixed", True)])
def test_the_wrapper_with_inductor_triton_kernels_beside_ours_loads_and_runs(case, reverse):
    """The training steps that failed to load on an H200 (inductor's Triton kernels beside ours)."""
    _interpreted("check_compiled_beside_inductor_triton_kernels", case, reverse)


@pytest.mark.parametrize("case,reverse", [("linear", True), ("rglru", False)])
def test_a_symbolic_length_keeps_the_kernel(case, reverse):
    _interpreted("check_compiled_symbolic_length", case, reverse)


# ---- the pass's decisions, on graphs of fake CUDA tensors (no GPU needed) ----------------------

def _graph(body, init_shapes, xs_shapes, dtype=torch.float32, device="cuda", closure_shapes=()):
    with FakeTensorMode(allow_non_fake_inputs=True):
        init = [torch.empty(s, dtype=d, device=device) for s, d in _with_dtype(init_shapes, dtype)]
        xs = [torch.empty(s, dtype=dtype, device=device) for s in xs_shapes]
        closed = [torch.empty(s, dtype=dtype, device=device) for s in closure_shapes]

    def f(init, xs, closed):
        return scan(lambda c, x: body(c, x, closed), init, xs)

    return make_fx(f, tracing_mode="fake")(init, xs, closed)


def _with_dtype(shapes, dtype):
    """``(shape, dtype)`` per entry: a shape, or a shape whose last item is its dtype."""
    out = []
    for s in shapes:
        has_dtype = bool(s) and isinstance(s[-1], torch.dtype)
        out.append((tuple(s[:-1]), s[-1]) if has_dtype else (tuple(s), dtype))
    return out


def _scan_node(gm):
    return next(iter(gm.graph.find_nodes(op="call_function", target=SCAN)))


def _linear(c, x, w):
    return [x[0] * c[0] + x[1]], [c[0]]


def test_applies_to_a_pointwise_body_and_counts_it():
    gm = _graph(_linear, [(4, 8)], [(16, 4, 8), (16, 4, 8)])
    source, why = pointwise_scan.plan(gm, _scan_node(gm))
    assert source is not None and why == ""
    assert "for t in range(T // 8):" in source and "tl.store" in source  # T: a launch argument
    reset_pass_counts()
    assert pointwise_scan.lower_pointwise_scans(gm) == 1
    assert pass_counts()[pointwise_scan.PASS_NAME] == {"applied": 1, "skipped": 0, "failed": 0}
    assert not gm.graph.find_nodes(op="call_function", target=SCAN)
    (call,) = gm.graph.find_nodes(op="call_function", target=OP)
    assert call.args[0].startswith("zb64:") and call.args[0].isascii() and "\n" not in call.args[0] \
        and not set(call.args[0]) & set("()[]'\"# ")  # one token, wherever inductor writes it
    assert pointwise_scan.unpack(call.args[0]) == source
    outs = call.meta["val"]
    assert [tuple(v.shape) for v in outs] == [(4, 8), (16, 4, 8)] and all(v.device.type == "cuda" for v in outs)


def test_applies_to_a_body_summing_into_a_smaller_carry():
    """A backward's weight-gradient carry: g + sum over the batch of a pointwise value."""
    def body(c, x, w):
        h, g = c
        return [x[0] * h, g + (x[0] * h * w[0]).sum(0)], [h]

    gm = _graph(body, [(4, 8), (8,)], [(16, 4, 8)], closure_shapes=[(8,)])
    assert pointwise_scan.plan(gm, _scan_node(gm))[0] is not None


def test_applies_to_a_y_summed_over_the_last_dim_and_an_x_row_placed_by_its_view():
    """Mamba: E = (B, D, N) from the carry; the y row (B, D) is a sum over N; C_t (B, N) is not
    broadcastable to E but its one use, ``unsqueeze(1)``, is."""
    def body(c, x, w):
        h = x[0] * c[0] + x[1]
        return [h], [(h * x[2].unsqueeze(1)).sum(-1)]

    gm = _graph(body, [(4, 8, 16)], [(16, 4, 8, 16), (16, 4, 8, 16), (16, 4, 16)])
    source, why = pointwise_scan.plan(gm, _scan_node(gm))
    assert source is not None, why
    assert "a2_ptr + (e0 * a2_s0 + e2 * a2_s1)" in source  # C_t loaded along E's dims 0 and 2


@pytest.mark.parametrize("name,body,init,xs,why", [
    ("matmul", lambda c, x, w: ([torch.tanh(c[0] @ w[0] + x[0])], [c[0]]), [(8, 8)], [(16, 8, 8)], "mm"),
    ("reduction", lambda c, x, w: ([c[0].sum(-1, keepdim=True) * x[0]], [c[0]]), [(4, 8)], [(16, 4, 8)], "sum"),
    ("integer carry", lambda c, x, w: ([c[0] + x[0], c[1] + 1], [c[0]]), [(4, 8), (torch.int64,)], [(16, 4, 8)],
     "dtype"),
    ("mixed shapes", lambda c, x, w: ([c[0] + x[0], c[1] * 2], [c[0]]), [(4, 8), (3,)], [(16, 4, 8)], "shape"),
    ("a leaf placed two ways", lambda c, x, w: ([c[0] * x[0].unsqueeze(-1) + x[0].unsqueeze(1)], [c[0]]),
     [(4, 8, 8)], [(16, 4, 8)], "different ways"),
    ("a leaf used unviewed", lambda c, x, w: ([c[0] + x[0].unsqueeze(-1)], [x[0] * 2]), [(4, 8, 8)], [(16, 4, 8)],
     "not broadcastable"),
    ("a y sum constant along a dim", lambda c, x, w: ([c[0] + x[0]], [x[0].expand(4, 8, 16).sum(-1)]),
     [(4, 8, 16)], [(16, 4, 1, 16)], "in order"),
    ("a y neither E's nor a sum", lambda c, x, w: ([c[0] * 2], [c[0].sum(-1) + 1]), [(4, 8, 16)], [(16, 4, 8, 16)],
     "sum over elements"),
    ("a view that moves data", lambda c, x, w: ([(c[0].reshape(8, 4) * 2).reshape(4, 8) + x[0]], [c[0]]),
     [(4, 8)], [(16, 4, 8)], "moves data"),
])
def test_refuses_and_leaves_the_graph_as_it_was(name, body, init, xs, why):
    closures = [(8, 8)] if name == "matmul" else []
    gm = _graph(body, init, xs, closure_shapes=closures)
    source, reason = pointwise_scan.plan(gm, _scan_node(gm))
    assert source is None and why in reason, reason
    before = gm.code
    reset_pass_counts()
    assert pointwise_scan.lower_pointwise_scans(gm) == 0
    assert gm.code == before
    assert pass_counts()[pointwise_scan.PASS_NAME]["skipped"] == 1


def test_refuses_a_scan_of_no_steps():
    """(A traced scan of static length 0 has no scan node; a graph could still hold one.)"""
    gm = _graph(_linear, [(4, 8)], [(16, 4, 8), (16, 4, 8)])
    node = _scan_node(gm)
    for x in node.args[2]:
        x.meta["val"] = x.meta["val"].new_empty((0, 4, 8))
    node.meta["val"] = [node.meta["val"][0], node.meta["val"][1].new_empty((0, 4, 8))]
    assert "no steps" in pointwise_scan.plan(gm, node)[1]


def test_cpu_scans_keep_their_loop_kernel():
    gm = _graph(_linear, [(4, 8)], [(16, 4, 8), (16, 4, 8)], device="cpu")
    assert "devices" in pointwise_scan.plan(gm, _scan_node(gm))[1]


def test_it_is_off_unless_enabled():
    gm = _graph(_linear, [(4, 8)], [(16, 4, 8), (16, 4, 8)])
    reset_pass_counts()
    with pointwise_scan.kernels_enabled(False):
        assert pointwise_scan.lower_pointwise_scans(gm) == 0
    assert pass_counts()[pointwise_scan.PASS_NAME] == {"applied": 0, "skipped": 1, "failed": 0}
    assert gm.graph.find_nodes(op="call_function", target=SCAN)


def test_passes_off_turns_it_off():
    gm = _graph(_linear, [(4, 8)], [(16, 4, 8), (16, 4, 8)])
    reset_pass_counts()
    with passes_off(pointwise_scan.PASS_NAME):
        assert pointwise_scan.lower_pointwise_scans(gm) == 0
    assert gm.graph.find_nodes(op="call_function", target=SCAN)
    assert pass_counts()[pointwise_scan.PASS_NAME]["skipped"] == 1


# ---- on a GPU ---------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("reverse", [False, True])
def test_cuda_forward_and_training_step_as_one_kernel_each(case, dtype, reverse, fresh_dynamo):
    import pointwise_scan_cases

    pointwise_scan_cases.check_compiled(case, reverse, "cuda", dtype)


@cuda
@pytest.mark.parametrize("case", ["linear", "rglru"])
def test_cuda_bfloat16_forward(case, fresh_dynamo):
    import pointwise_scan_cases

    pointwise_scan_cases.check_bfloat16_forward(case, False, "cuda")
