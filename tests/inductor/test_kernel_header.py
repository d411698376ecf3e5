"""The loop kernel's own precompiled header (``inductor.codegen.kernel_header``): inductor's
``cpp_prefix.h`` with GCC's pending template instantiations done, built in the background the first
time a kernel asks for it; kernels built with it give the same numbers as with inductor's (the same
bits) and as the loop; a header that does not serve is not used again, the kernel built with
inductor's with one warning; a header that cannot be built is left ``.failed``."""
import os
import subprocess
import warnings

import pytest
import torch
from conftest import assert_trees_close, reference_scan
from test_kernel_build import _rnn

from torch_scan_hop import scan
from torch_scan_hop.inductor import codegen
from torch_scan_hop.inductor.codegen import kernel_build, kernel_header

_INDUCTOR = ("g++ /tmp/k.main.cpp -D TORCH_INDUCTOR_CPP_WRAPPER -D  C10_USING_CUSTOM_GENERATED_MACROS -O3 -shared "
             "-fPIC -include /tmp/p/h.h -I/py/include -march=native  -o /tmp/k.so  -Wl,--push-state,--no-as-needed "
             "-ltorch -Wl,--pop-state -lgomp -L/torch/lib")


def test_header_flags_leave_out_the_source_output_header_and_link():
    assert kernel_header.header_flags(_INDUCTOR) == [
        "g++", "-D", "TORCH_INDUCTOR_CPP_WRAPPER", "-D", "C10_USING_CUSTOM_GENERATED_MACROS", "-O3", "-fPIC",
        "-I/py/include", "-march=native"]


@pytest.mark.parametrize("command", [
    _INDUCTOR.replace(" -include /tmp/p/h.h", ""),  # no precompiled header
    _INDUCTOR,  # a header without its .gch (not GCC's)
])
def test_commands_without_a_gcc_precompiled_header_are_left_alone(command):
    assert kernel_header.with_own_header(command) is None


def _compiled_forward(step, c0, xs):
    torch._dynamo.reset()
    codegen.reset_pass_counts()
    with torch.no_grad(), torch._inductor.config.patch(force_disable_caches=True, compile_threads=1):
        got = torch.compile(lambda c0, xs: scan(step, c0, xs))(c0, xs)
    return got, codegen.pass_counts().get("loop_kernel_header", {})


def _our_header():
    """Our header for this machine's kernel command, built (``prepare_header``). Skipped where
    inductor's command has no GCC precompiled header, or its GCC has no plugin support; a GCC
    with plugins that did not build it fails here, with the compiler's output."""
    if kernel_build.prepare_header():
        return
    asked = sorted(kernel_header._asked)
    if not asked:
        pytest.skip("inductor's kernel command names no GCC precompiled header here")
    configured = subprocess.run(["g++", "-v"], capture_output=True, text=True).stderr
    log = next((open(p + ".log").read() for p in asked if os.path.isfile(p + ".log")), "(no log)")
    if "--enable-plugin" not in configured:
        pytest.skip(f"this g++ has no plugin support: our header is not built ({log[-300:]})")
    pytest.fail(f"g++ with plugin support did not build our header {asked}: {log[-2000:]}")


def test_a_kernel_built_with_our_header_gives_the_same_bits():
    step, c0, xs = _rnn(64)
    _our_header()
    got, counts = _compiled_forward(step, c0, xs)
    assert counts == {"applied": 1, "skipped": 0, "failed": 0}
    with codegen.passes_off("loop_kernel_header"):  # inductor's header
        theirs, counts = _compiled_forward(step, c0, xs)
    assert counts == {"applied": 0, "skipped": 1, "failed": 0}
    assert all(torch.equal(a, b) for a, b in zip(torch.utils._pytree.tree_leaves(got),
                                                 torch.utils._pytree.tree_leaves(theirs)))
    assert_trees_close(got, reference_scan(step, c0, xs), rtol=1e-4, atol=1e-5)


def test_a_header_that_does_not_serve_is_not_used_again(monkeypatch, tmp_path):
    step, c0, xs = _rnn(64)
    unusable = tmp_path / "unusable.h"
    unusable.write_text('#error "not usable (simulated)"\n')

    def with_unusable_header(command):
        if (tmp_path / "unusable.h.failed").exists():
            return None
        parts = command.split(" ")
        parts[parts.index("-include") + 1] = str(unusable)
        return " ".join(parts)
    monkeypatch.setattr(kernel_header, "with_own_header", with_unusable_header)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, counts = _compiled_forward(step, c0, xs)
    assert counts == {"applied": 0, "skipped": 0, "failed": 1}
    assert len([w for w in caught if issubclass(w.category, kernel_build.KernelHeaderWarning)]) == 1
    assert (tmp_path / "unusable.h.failed").exists()
    assert_trees_close(got, reference_scan(step, c0, xs), rtol=1e-4, atol=1e-5)


def test_a_header_that_cannot_be_built_is_left_failed(tmp_path):
    header = tmp_path / "h.h"
    header.write_text("#include <cstdint>\n")
    flags = ["false"]  # a compiler that fails
    ours = kernel_header.own_header_path(str(header), flags)
    kernel_header.start_building(str(header), ours, flags)
    kernel_header.wait_for_builds()
    assert os.path.isfile(ours + ".failed") and not os.path.exists(ours) and not os.path.exists(ours + ".lock")
