"""The wrapper passes run as one declared pipeline per wrapper kind (``inductor.codegen``): a pass
that cannot read inductor's generated code (a new torch writing a line differently), or raises,
leaves the wrapper as inductor generated it, with ONE warning naming the pass, and the compiled
scan still gives the loop's values; ``pass_counts`` says which passes fired."""
import warnings

import pytest
import torch
from conftest import reference_scan
from torch._inductor.utils import run_and_get_code

from torch_scan_hop import scan
from torch_scan_hop.inductor import codegen
from torch_scan_hop.inductor.codegen import blas, loop_kernel, passes, pipeline, python_text

LENGTH = 70  # past loop_kernel's and blas' 64 steps: every Python pass has work


@pytest.fixture(autouse=True)
def fresh_counts():
    codegen.reset_pass_counts()
    yield
    codegen.reset_pass_counts()


def _rnn():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(16, 16, generator=gen) * 0.3

    def step(c, x):
        c = torch.tanh(c @ w + x)
        return c, c.sum(-1)
    return step, torch.randn(4, 16, generator=gen), torch.randn(LENGTH, 4, 16, generator=gen)


def _compiled_forward(step, c0, xs):
    """Values and the generated code of one compiled forward (one graph, one wrapper)."""
    torch._dynamo.reset()
    fn = torch.compile(lambda c0, xs: scan(step, c0, xs))
    with torch._inductor.config.patch(force_disable_caches=True), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, codes = run_and_get_code(fn, c0, xs)
    return got, codes, [w for w in caught if issubclass(w.category, codegen.WrapperPassWarning)]


def _assert_loops_values(got, step, c0, xs):
    want = reference_scan(step, c0, xs)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


def test_an_ordinary_compiled_scan_counts_the_passes_that_fired():
    step, c0, xs = _rnn()
    c0.requires_grad_()
    torch._dynamo.reset()
    fn = torch.compile(lambda c0, xs: scan(step, c0, xs))
    with torch._inductor.config.patch(force_disable_caches=True), warnings.catch_warnings():
        warnings.simplefilter("error", codegen.WrapperPassWarning)
        c, ys = fn(c0, xs)
        torch.autograd.grad(c.sum() + ys.sum(), c0)
    _assert_loops_values((c, ys), step, c0, xs)
    counts = codegen.pass_counts()
    assert counts["python_for_loops"]["applied"] == 2  # forward, backward
    for name in ("pool_loop_buffers", "run_loops_as_one_kernel", "release_finished_loops"):
        assert counts[name]["applied"] == 2, (name, counts)
    assert counts["drop_counter_inits"]["applied"] >= 1  # the counter's kernel (where inductor made one)
    if blas.blas_is_atens_float32_mm():
        assert counts["blas_extern_calls"]["applied"] >= 2
    assert all(c["failed"] == 0 for c in counts.values()), counts
    assert {p.name for p in passes.PYTHON_WRAPPER.passes} <= set(counts)


def test_a_wrapper_line_the_passes_cannot_read_leaves_the_generated_wrapper(monkeypatch):
    """As if a new torch wrote the line the loop's kernel is defined on differently: the
    precondition of ``run_loops_as_one_kernel`` fails, so the wrapper is used as generated
    (a Python ``for``, no pools: the passes before it are dropped too), with one warning."""
    step, c0, xs = _rnn()
    monkeypatch.setattr(loop_kernel, "_WAIT", "async_compile.wait(globals(), new_in_torch_3=True)")
    got, codes, caught = _compiled_forward(step, c0, xs)
    _assert_loops_values(got, step, c0, xs)
    assert [str(w.message).count("'run_loops_as_one_kernel'") for w in caught] == [1]
    assert "async_compile.wait(globals(), new_in_torch_3=True)" in str(caught[0].message)
    (code,) = codes
    assert f"_step in range({LENGTH}):" in code and "scan_steps_" not in code and "_pool0" not in code
    counts = codegen.pass_counts()
    assert counts["run_loops_as_one_kernel"]["failed"] == 1
    assert counts.get("pool_loop_buffers", {}).get("applied", 0) == 0  # fired on a text that was dropped


def test_a_pass_that_raises_leaves_the_generated_wrapper(monkeypatch):
    step, c0, xs = _rnn()

    def broken(code):
        raise IndexError("list index out of range")

    monkeypatch.setattr(python_text, "pool_loop_buffers", broken)
    got, codes, caught = _compiled_forward(step, c0, xs)
    _assert_loops_values(got, step, c0, xs)
    assert len(caught) == 1 and "'pool_loop_buffers'" in str(caught[0].message)
    assert "IndexError" in str(caught[0].message)
    assert "scan_steps_" not in codes[0] and f"_step in range({LENGTH}):" in codes[0]
    assert codegen.pass_counts()["pool_loop_buffers"]["failed"] == 1


def test_passes_skip_a_wrapper_without_our_loops():
    code = "def call(args):\n    buf0 = empty_strided_cpu((4, ), (1, ), torch.float32)\n    return (buf0, )\n"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert pipeline.run(passes.PYTHON_WRAPPER, code) == code
        assert pipeline.run(passes.CPP_WRAPPER, code, {"jit": True}) == code
    counts = codegen.pass_counts()
    assert all(c == {"applied": 0, "skipped": 1, "failed": 0} for c in counts.values()), counts


CPP_LOOP = """\
    for (int64_t buf5_step = 0; buf5_step < 64L; ++buf5_step) {
        AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_cpu_mm_out(b_buf5, b_arg2_1, arg2_1));
    }"""


def test_cpp_mm_with_nowhere_to_define_its_blas_helper_leaves_the_generated_wrapper(monkeypatch):
    """The C++ pipeline's ``call_blas_for_mm`` needs the ``inductor_entry_impl`` line: without it
    (a torch naming its entry otherwise) the wrapper stays as generated, with one warning."""
    monkeypatch.setattr(blas, "blas_is_atens_float32_mm", lambda: True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert pipeline.run(passes.CPP_WRAPPER, "void entry_impl_v2(\n" + CPP_LOOP, {"jit": True}) \
            == "void entry_impl_v2(\n" + CPP_LOOP
        rewritten = pipeline.run(passes.CPP_WRAPPER, "void inductor_entry_impl(\n" + CPP_LOOP, {"jit": True})
    assert [str(w.message).count("'call_blas_for_mm'") for w in caught] == [1]
    assert "scan_blas_mm_out(b_buf5" in rewritten
    assert codegen.pass_counts()["call_blas_for_mm"] == {"applied": 1, "skipped": 0, "failed": 1}


def test_cpp_mm_helper_computes_with_small_gemm_where_the_header_defines_it(monkeypatch):
    """``call_blas_for_mm``'s helper calls small_gemm's kernel first where its source is defined
    before the entry (put in the header at codegen), else ``sgemm_`` alone; one ``small_gemm``
    decision counted per call rewritten, and none when the pipeline's text is dropped."""
    from torch_scan_hop.inductor.codegen import small_gemm

    monkeypatch.setattr(blas, "blas_is_atens_float32_mm", lambda: True)
    loop = "void inductor_entry_impl(\n" + CPP_LOOP + "\n" + CPP_LOOP
    for header, how in (("", "skipped"), (small_gemm.NAMESPACE + "\n}\n", "applied")):
        codegen.reset_pass_counts()
        lines = pipeline.run(passes.CPP_WRAPPER, header + loop, {"jit": True}).split("\n")
        assert len(lines) == len((header + loop).split("\n"))
        assert lines[header.count("\n")] == blas.mm_out_helper(how == "applied") + "void inductor_entry_impl("
        assert ("scan_small_gemm::sgemm(" in lines[header.count("\n")]) == (how == "applied")
        assert codegen.pass_counts()[small_gemm.NAME] == {"applied": 0, "skipped": 0, how: 2, "failed": 0}
    codegen.reset_pass_counts()
    rewrite = passes.cpp_text.call_blas_for_mm
    monkeypatch.setattr(passes.cpp_text, "call_blas_for_mm", lambda code, decisions: rewrite(code, decisions)[1 / 0])
    with pytest.warns(pipeline.WrapperPassWarning, match="call_blas_for_mm"):
        assert pipeline.run(passes.CPP_WRAPPER, loop, {"jit": True}) == loop
    assert small_gemm.NAME not in codegen.pass_counts()


def test_passes_off_skips_a_pass():
    code = "        buf5 = [buf0]\n        for buf5_step in range(3):\n            buf5[0] = buf5[0]\n        buf6 = 1"
    with codegen.passes_off("release_finished_loops"):
        assert pipeline.run(passes.PYTHON_WRAPPER, code) == code
    assert "del buf5" in pipeline.run(passes.PYTHON_WRAPPER, code)


def test_the_pools_precondition_reads_a_carried_view_as_one_value():
    """A carried value may be a view call with commas of its own; a body that hands on fewer
    values than it carries (a torch writing its outputs another way) fails the precondition."""
    code = ("        buf5 = [buf1, reinterpret_tensor(buf0, (2, 3), (3, 1), 0)]\n"
            "        for buf5_step in range(4):\n"
            "            b_buf5 = empty_strided_cpu((2, 3), (3, 1), torch.float32)\n"
            "            buf5[0] = buf5[0]\n"
            "            buf5[1] = b_buf5\n"
            "        buf6 = buf5[1]")
    assert passes._unwritten_carries(code) is None
    short = code.replace("    buf5[1] = b_buf5\n", "")
    assert "writes back carried values [0] of 2" in passes._unwritten_carries(short)
