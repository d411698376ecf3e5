"""The C++ wrapper's counted loops (``inductor.codegen.cpp_loop``, ``inductor.codegen.cpp_text``) and the
loop-body rewrites of ``inductor.body_passes``: the text rewrite that pools a loop's per-step buffers, and
``addmm`` unfused where the bias add can join the body's pointwise kernel. Compiled C++
wrappers run in a child interpreter: tests/inductor/test_cpp_wrapper.py."""
import pytest
import torch
from conftest import assert_trees_close, reference_scan
from torch._inductor.utils import run_and_get_code

from torch_scan_hop import scan
from torch_scan_hop.inductor.body_passes import unfuse_bias_adds
from torch_scan_hop.inductor.codegen.cpp_text import pool_cpp_loop_buffers

LOOP = """\
    static constexpr int64_t int_array_0[] = {{256L, 8L}};
    for (int64_t buf2_step = 0; buf2_step < 256; ++buf2_step) {{
        // subgraph: scan_loop_body
        AtenTensorHandle b_arg0_1_handle;
        AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_assign_tensors_out(buf3, &b_arg0_1_handle));
        RAIIAtenTensorHandle b_arg0_1(b_arg0_1_handle);
        AtenTensorHandle b_arg2_1_handle;
        AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_assign_tensors_out(buf5, &b_arg2_1_handle));
        RAIIAtenTensorHandle b_arg2_1(b_arg2_1_handle);
        static constexpr int64_t int_array_3[] = {{8L, 64L}};
        static constexpr int64_t int_array_4[] = {{64L, 1L}};
        AtenTensorHandle b_buf5_handle;
        AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(2, int_array_3, int_array_4, cached_torch_dtype_float32, cached_torch_device_type_cpu,  0, &b_buf5_handle));
        RAIIAtenTensorHandle b_buf5(b_buf5_handle);
        AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_cpu_mm_out(b_buf5, b_arg2_1, arg2_1));
        auto b_buf6 = std::move(b_buf5);  // reuse
        cpp_fused_1((float*)(b_buf6.data_ptr()), (int64_t*)(b_arg0_1.data_ptr()));
        buf3.reset();
        buf3 = std::move(b_arg0_1);
        buf5.reset();
        buf5 = std::move({last});
    }}
    buf7 = buf5;"""


def test_per_step_buffers_come_from_a_pool_of_two():
    code = pool_cpp_loop_buffers(LOOP.format(last="b_buf6"))
    assert len(code.split("\n")) == len(LOOP.split("\n"))
    assert code.count("aoti_torch_empty_strided(") == 1  # the pool's, before the loop
    head = next(line for line in code.split("\n") if "for (int64_t buf2_step" in line)
    assert head.startswith("    static constexpr int64_t buf2_pool0_sizes[] = {8L, 64L}; ")
    assert "RAIIAtenTensorHandle buf2_pool0[2];" in head
    assert "aoti_torch_assign_tensors_out(buf2_pool0[buf2_step & 1], &b_buf5_handle)" in code


def _handed_on_as_view_of(base):
    """LOOP whose last output is inductor's view of ``base`` made in its place (a bias
    gradient summed as (1, n), handed on as (n,))."""
    view = ("        auto b_buf8 = wrap_with_raii_handle_if_needed(reinterpret_tensor_wrapper("
            f"{base}, 1, int_array_5, int_array_6, 0L)); {base}.reset();  // reuse")
    code = LOOP.format(last="b_buf8")
    return code.replace("        buf3.reset();", view + "\n        buf3.reset();", 1)


def test_a_view_made_in_place_of_a_fresh_buffer_is_pooled_with_it():
    code = pool_cpp_loop_buffers(_handed_on_as_view_of("b_buf6"))
    assert code.count("aoti_torch_empty_strided(") == 1  # the pool's, before the loop
    assert "aoti_torch_assign_tensors_out(buf2_pool0[buf2_step & 1], &b_buf5_handle)" in code


def test_a_view_of_a_carried_input_leaves_the_loop_alone():
    code = _handed_on_as_view_of("b_arg0_1")
    assert pool_cpp_loop_buffers(code) == code


@pytest.mark.parametrize("last", ["b_arg0_1", "b_view"])
def test_outputs_that_could_outlive_an_iteration_leave_the_loop_alone(last):
    """A carried input leaving at another position, or a value not traced to an allocation."""
    code = LOOP.format(last=last)
    assert pool_cpp_loop_buffers(code) == code


def test_allocations_of_a_loop_nested_in_the_body_are_not_pooled():
    """An inner loop runs several times per outer step: its buffers are not the outer's to pool."""
    inner = "\n".join("    " + line if line.strip() else line for line in [
        "        while (1) {",
        "            AtenTensorHandle b_in_handle;",
        "            AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(2, int_array_3, int_array_4, "
        "cached_torch_dtype_float32, cached_torch_device_type_cpu,  0, &b_in_handle));",
        "            RAIIAtenTensorHandle b_in(b_in_handle);",
        "            b_x = std::move(b_in);",
        "        }"])
    code = LOOP.format(last="b_buf6").replace("        auto b_buf6 = std::move(b_buf5);  // reuse",
                                              inner[4:] + "\n        auto b_buf6 = std::move(b_buf5);  // reuse")
    pooled = pool_cpp_loop_buffers(code)
    assert "&b_in_handle" in pooled and "aoti_torch_assign_tensors_out(buf2_pool0[buf2_step & 1], &b_buf5_handle)" in pooled
    assert "buf2_pool1" not in pooled  # the inner loop's allocation kept


def _body_graph(fn, *args):
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn)(*args)


@pytest.mark.parametrize("use,unfused", [
    (torch.tanh, True),                     # pointwise: the add joins tanh's kernel
    (lambda h: h.view(-1).relu(), True),    # through a view
    (lambda h: h.sum(-1), False),           # a reduction: addmm stays
])
def test_bias_add_unfused_only_before_pointwise_uses(use, unfused):
    args = torch.randn(8, 64), torch.randn(8, 64), torch.randn(64, 64)
    gm = _body_graph(lambda b, c, w: use(torch.addmm(b, c, w)), *args)
    assert unfuse_bias_adds(gm) == int(unfused)
    targets = {n.target for n in gm.graph.nodes}
    assert (torch.ops.aten.addmm.default not in targets) == unfused
    assert_trees_close(gm(*args), use(torch.addmm(*args)))


def test_scaled_addmm_stays():
    args = torch.randn(8, 64), torch.randn(8, 64), torch.randn(64, 64)
    gm = _body_graph(lambda b, c, w: torch.tanh(torch.addmm(b, c, w, beta=0.5)), *args)
    assert unfuse_bias_adds(gm) == 0


@pytest.mark.parametrize("bias", ["row", "matrix"])
def test_compiled_rnn_calls_mm_not_addmm_in_its_loop(bias):
    """The tanh RNN's step ``tanh(c @ W + x)`` (and a Linear's row bias): ``mm`` plus the add
    fused into tanh's kernel, values and gradients as the loop's."""
    torch.manual_seed(0)
    w, b = torch.randn(16, 16) * 0.3, torch.randn(16)

    def cell(c, x):
        c = torch.tanh(c @ w + b) * x if bias == "row" else torch.tanh(c @ w + x)
        return c, c.sum(-1)

    c0, xs = torch.randn(4, 16, requires_grad=True), torch.randn(5, 4, 16, requires_grad=True)
    compiled = torch.compile(lambda c0, xs: scan(cell, c0, xs), fullgraph=True)
    got, codes = run_and_get_code(lambda: compiled(c0, xs))
    want = reference_scan(cell, c0, xs)
    assert_trees_close(got, want)
    assert_trees_close(torch.autograd.grad(sum(v.sum() for v in got), (c0, xs)),
                       torch.autograd.grad(sum(v.sum() for v in want), (c0, xs)))
    loop = codes[0][codes[0].index("_step in range(5)"):]
    assert ("extern_kernels.mm(" in loop or "scan_blas_sgemm(" in loop) and "addmm" not in loop  # ATen's mm or its BLAS call


@pytest.mark.parametrize("reverse", [False, True])
def test_dynamic_length_runs_as_a_counted_loop(reverse):
    """A length Dynamo made symbolic (``mark_dynamic``) is a ``for step in range(s)`` loop too,
    with its per-step buffers pooled and its index checks left out (``u0 < s`` holds at both
    ends of the range); one compiled graph serves several lengths, values and gradients as the
    loop's (before: inductor's while loop, ~1.8x the step's cost)."""
    torch.manual_seed(0)
    w = torch.randn(16, 16) * 0.3

    def cell(c, x):
        c = torch.tanh(c @ w + x)
        return c, c.sum(-1)

    compiled = torch.compile(lambda c0, xs: scan(cell, c0, xs, reverse=reverse), fullgraph=True)
    for n in (5, 9):
        c0, xs = torch.randn(4, 16, requires_grad=True), torch.randn(n, 4, 16, requires_grad=True)
        torch._dynamo.mark_dynamic(xs, 0)
        got, codes = run_and_get_code(lambda: compiled(c0, xs))
        want = reference_scan(cell, c0, xs, reverse=reverse)
        assert_trees_close(got, want)
        assert_trees_close(torch.autograd.grad(sum(v.sum() for v in got), (c0, xs)),
                           torch.autograd.grad(sum(v.sum() for v in want), (c0, xs)))
        if n == 5:  # compiled on the first call only
            import re

            loops = re.findall(r"for (\w+)_step in range\((s\d+)\):", codes[0])
            assert loops, "no counted loop over the symbolic length"
            loop = codes[0][codes[0].index(f"for {loops[0][0]}_step"):]
            assert f"{loops[0][0]}_pool0[{loops[0][0]}_step & 1]" in loop
            assert "raise RuntimeError" not in loop.split("\n    del ")[0] and "while " not in codes[0]


ROW_VIEW = """\
void inductor_entry_impl(
    for (int64_t buf2_step = 0; buf2_step < 256; ++buf2_step) {
        AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_cpu_mm_out(b_buf5, b_arg2_1, arg2_1));
        auto b_buf7 = wrap_with_raii_handle_if_needed(reinterpret_tensor_wrapper(b_arg1_1, 1, int_array_5, int_array_6, 8L*u0));  // alias
        {between}
        cpp_fused_1((float*)(b_buf5.data_ptr()), (float*)(b_buf7.data_ptr()), u0);
    }
    AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_cpu_mm_out(buf9, buf5, arg2_1));"""


def test_row_view_read_through_its_pointer_becomes_pointer_arithmetic():
    from torch_scan_hop.inductor.codegen.cpp_text import cheapen_loop_calls

    code = ROW_VIEW.replace("{between}", "")
    cheaper = cheapen_loop_calls(code, blas=False)
    assert len(cheaper.split("\n")) == len(code.split("\n"))
    assert "reinterpret_tensor_wrapper" not in cheaper and "b_buf7.data_ptr()" not in cheaper
    assert "cpp_fused_1((float*)(b_buf5.data_ptr()), ((float*)(b_arg1_1.data_ptr()) + (8L*u0)), u0);" in cheaper
    assert "scan_blas_mm_out" not in cheaper  # blas=False: mm stays ATen's


@pytest.mark.parametrize("between", [
    "b_arg1_1.reset();",                                                # its base gone before the read
    "AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_cpu_mm_out(b_buf7, b_buf5, arg2_1));",  # read as a handle
])
def test_row_view_stays_a_view_unless_only_its_pointer_is_read_while_its_base_lives(between):
    from torch_scan_hop.inductor.codegen.cpp_text import cheapen_loop_calls

    cheaper = cheapen_loop_calls(ROW_VIEW.replace("{between}", between), blas=False)
    assert "reinterpret_tensor_wrapper(b_arg1_1" in cheaper and "(float*)(b_buf7.data_ptr())" in cheaper


def test_mm_in_a_counted_loop_calls_blas_through_a_helper_defined_before_the_entry():
    from torch_scan_hop.inductor.codegen.blas import BLAS_MM_OUT
    from torch_scan_hop.inductor.codegen.cpp_text import cheapen_loop_calls

    code = ROW_VIEW.replace("{between}", "")
    lines = cheapen_loop_calls(code, blas=True).split("\n")
    assert len(lines) == len(code.split("\n"))
    assert lines[0] == BLAS_MM_OUT + "void inductor_entry_impl("
    assert "scan_blas_mm_out(b_buf5, b_arg2_1, arg2_1)" in lines[2]
    assert "aoti_torch_cpu_mm_out(buf9, buf5, arg2_1)" in lines[-1]  # outside the loop: left alone
