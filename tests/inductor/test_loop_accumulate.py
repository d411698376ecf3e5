"""A sum a loop run as one C++ kernel accumulates with ``scan_blas_addmm`` (a weight gradient) is
accumulated in its own buffer (``inductor.codegen.accumulate``): the copy of the old sum into a
second buffer is ATen's no-op, the bits stay the Python loop's (``test_loop_kernel``'s training
test checks both on the RNN's backward). Here: a user's init is never written, and the plans the
rewrite must leave alone."""
import re

import torch
from torch._inductor.utils import run_and_get_code
from conftest import assert_trees_close, reference_scan

from torch_scan_hop import scan
from torch_scan_hop.inductor import codegen
from torch_scan_hop.inductor.codegen import accumulate, loop_kernel


def test_a_users_init_is_not_written_and_bits_stay():
    """``g = addmm(g, x.T, x)`` with the user's ``g0``: step 0 reads ``g0`` and writes the pool's
    buffer, later steps accumulate there; ``g0`` keeps its values."""
    def step(g, x):
        return torch.addmm(g, x.T, x), x.sum(-1)

    g0, xs = torch.randn(8, 8), torch.randn(64, 4, 8)
    before = g0.clone()
    fn = lambda g0, xs: scan(step, g0, xs)  # noqa: E731
    with torch.no_grad(), torch._inductor.config.patch(force_disable_caches=True):
        torch._dynamo.reset()
        got, (code,) = run_and_get_code(torch.compile(fn), g0, xs)
        torch._dynamo.reset()
        with codegen.passes_off("run_loops_as_one_kernel"):
            want = torch.compile(fn)(g0, xs)
    assert "scan_blas_addmm" in code and re.search(r"_pool\d+\[0\] if 64 > 0", code), code[code.find("def call"):][:2000]
    assert torch.equal(g0, before)
    for g, w in zip(got, want):
        assert torch.equal(g, w), (g - w).abs().max()
    assert_trees_close(got, reference_scan(step, g0, xs), rtol=1e-4, atol=1e-4)


def _plan(later_read=False, strides=("(64LL)", "(1LL)")):
    """A plan of ``c1 = addmm(c1, a, b)`` into ``pool0[step & 1]``, optionally with a later call
    reading the old ``c1`` or ``self`` strides other than the output's."""
    plan = loop_kernel._Plan("buf2", "70")
    out = ("tensor", "pool0[step & 1]", None, ("pool", "buf2_pool0"))
    carry = ("tensor", "c1", None, ("carry", 1))
    a, b = ("tensor", "o0", None, ("outer", "x")), ("tensor", "c0", None, ("carry", 0))
    ints = [("int", "(1LL)")] * 10 + [("int", "(64LL)"), ("int", "(1LL)"), *(("int", s) for s in strides)]
    plan.call_args = [("scan_blas_addmm", [out, carry, a, b, *ints])]
    plan.calls = ["scan_steps_k0::kernel((float*)(pool0[step & 1]), (const float*)(c1), ...);"]
    if later_read:
        plan.call_args.append(("cpp_fused_0", [carry]))
        plan.calls.append("scan_steps_k1::kernel((float*)(c1));")
    plan.written = {1: out}
    plan.writes = ["c1 = pool0[step & 1];"]
    plan.fixups = ["buf2[1] = buf2_pool0[(70 - 1) & 1] if 70 > 0 else buf2[1]"]
    return plan


def test_the_rewrite_of_a_plan():
    codegen.reset_pass_counts()
    with codegen.passes_off("accumulate_in_place"):
        assert accumulate.accumulate_in_place(_plan()) == []
    plan = _plan()
    assert accumulate.accumulate_in_place(plan) == [1]
    assert codegen.pass_counts()["accumulate_in_place"] == {"applied": 1, "skipped": 1, "failed": 0}
    assert plan.calls[0].startswith("scan_steps_k0::kernel((float*)(pool0[0]), (const float*)(c1)")
    assert plan.writes == ["c1 = pool0[0];"]
    assert plan.fixups == ["buf2[1] = buf2_pool0[0] if 70 > 0 else buf2[1]"]


def test_plans_left_alone():
    for plan in (_plan(later_read=True), _plan(strides=("(1LL)", "(64LL)"))):
        calls, writes, fixups = list(plan.calls), list(plan.writes), list(plan.fixups)
        assert accumulate.accumulate_in_place(plan) == []
        assert (plan.calls, plan.writes, plan.fixups) == (calls, writes, fixups)
