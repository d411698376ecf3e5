"""The loop kernel's build (``inductor.codegen.kernel_build``): linked against libtorch only, its
binding compiled without ``<sstream>``, loaded when its first call comes, the same numbers as the
loop; a library that does not load that way is linked again as inductor links its kernels, a file
without ``<sstream>`` that does not build is built as inductor wrote it, each with one warning; a
kernel that does not build either way raises inductor's compile error at its first call."""
import warnings

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from conftest import assert_trees_close, reference_scan

from torch_scan_hop import scan
from torch_scan_hop.inductor import codegen
from torch_scan_hop.inductor.codegen import kernel_build

_INDUCTOR = ("g++ /tmp/k.cpp -D CPU_CAPABILITY_AVX512 -O3 -shared -fPIC -fopenmp -include /tmp/p.h -o /tmp/k.so "
             "-ltorch -ltorch_cpu -ltorch_python -lgomp -lc10 -L/torch/lib")


def test_relinked_names_libtorch_only_kept_as_needed():
    line = kernel_build.relinked(_INDUCTOR)
    assert "-ltorch_cpu" not in line.split(" ")
    assert " -Wl,--push-state,--no-as-needed -ltorch -Wl,--pop-state -ltorch_python -lgomp -lc10 " in line
    assert line.replace(" -Wl,--push-state,--no-as-needed -ltorch -Wl,--pop-state", " -ltorch -ltorch_cpu") == _INDUCTOR


@pytest.mark.parametrize("command", [
    _INDUCTOR.replace(" -ltorch_cpu", ""),  # no libtorch_cpu to leave out
    _INDUCTOR.replace("-ltorch -ltorch_cpu", "-ltorch_cpu -ltorch"),  # another order
    _INDUCTOR.replace(" -shared", " -c"),  # not a link
    "cl /LD k.cpp torch.lib torch_cpu.lib",  # Windows
])
def test_other_commands_are_left_alone(command):
    assert kernel_build.relinked(command) is None


_BINDING_2_9 = """
// Python bindings to call kernel():
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <sstream>
#include <cstdlib>
PyMODINIT_FUNC PyInit_kernel(void) {
    const char* str_addr = std::getenv("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR");
    std::istringstream iss(str_addr);
    uintptr_t addr = 0;
    iss >> addr;
    _torchinductor_pyobject_tensor_data_ptr = reinterpret_cast<decltype(_torchinductor_pyobject_tensor_data_ptr)>(addr);
}"""
_BINDING_2_15 = _BINDING_2_9.replace("""    std::istringstream iss(str_addr);
    uintptr_t addr = 0;
    iss >> addr;""", """    char* endptr = nullptr;
    uintptr_t addr = std::strtoull(str_addr, &endptr, 10);""")


def test_without_sstream_parses_the_address_with_strtoull():
    out = kernel_build.without_sstream(_BINDING_2_9)
    assert "stream" not in out and "#include <cstdlib>" in out
    assert "    uintptr_t addr = std::strtoull(str_addr, nullptr, 10);\n    _torchinductor_pyobject" in out
    assert out.count("\n") == _BINDING_2_9.count("\n") - 3
    assert kernel_build.without_sstream(_BINDING_2_15) == _BINDING_2_15.replace("#include <sstream>\n", "")


@pytest.mark.parametrize("text", [
    _BINDING_2_9.replace("#include <sstream>\n", ""),  # nothing to leave out
    _BINDING_2_9 + "\n#include <sstream>",  # twice
    _BINDING_2_9.replace("uintptr_t addr = 0;", "uintptr_t addr = 0; // read"),  # another parse
    "std::ostringstream out;\n" + _BINDING_2_9,  # the kernel reads a stream too
])
def test_other_bindings_are_left_alone(text):
    assert kernel_build.without_sstream(text) is None


def _rnn(length=96, h=16, b=4):
    w = torch.randn(h, h) * 0.3

    def step(c, x):
        c = torch.tanh(c @ w + x)
        return c, c.sum(-1)
    return step, torch.randn(b, h), torch.randn(length, b, h)


def _compiled_forward(step, c0, xs, **config):
    torch._dynamo.reset()
    codegen.reset_pass_counts()
    with torch.no_grad(), torch._inductor.config.patch(force_disable_caches=True, **config):
        got, (code,) = run_and_get_code(torch.compile(lambda c0, xs: scan(step, c0, xs)), c0, xs)
    counts = codegen.pass_counts()
    return got, code, counts.get("loop_kernel_link", {}), counts.get("loop_kernel_binding", {})


@pytest.mark.parametrize("threads", [1, 2])
def test_loop_kernel_linked_light_and_deferred_gives_the_loops_values(threads):
    step, c0, xs = _rnn()
    got, code, counts, binding = _compiled_forward(step, c0, xs, compile_threads=threads)
    assert "scan_deferred_kernel(globals(), 'scan_steps_" in code
    assert counts == {"applied": 1, "skipped": 0, "failed": 0}
    assert binding == {"applied": 1, "skipped": 0, "failed": 0}
    assert_trees_close(got, reference_scan(step, c0, xs), rtol=1e-4, atol=1e-5)


def test_a_library_that_does_not_load_is_linked_again(monkeypatch):
    step, c0, xs = _rnn()
    monkeypatch.setattr(kernel_build, "_load_error", lambda path: "a symbol not found (simulated)")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, _, counts, _ = _compiled_forward(step, c0, xs, compile_threads=1)  # built by the first call, here
    assert counts == {"applied": 0, "skipped": 0, "failed": 1}
    assert [w for w in caught if issubclass(w.category, kernel_build.KernelLinkWarning)]
    assert_trees_close(got, reference_scan(step, c0, xs), rtol=1e-4, atol=1e-5)


def test_a_file_without_sstream_that_does_not_build_is_built_as_inductor_wrote_it(monkeypatch):
    step, c0, xs = _rnn()
    light = kernel_build.without_sstream
    monkeypatch.setattr(kernel_build, "without_sstream", lambda text: light(text) + "\n#error simulated\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, _, _, binding = _compiled_forward(step, c0, xs, compile_threads=1)
    assert binding == {"applied": 0, "skipped": 0, "failed": 1}
    assert [w for w in caught if issubclass(w.category, kernel_build.KernelBindingWarning)]
    assert_trees_close(got, reference_scan(step, c0, xs), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_kernel_that_does_not_build_raises_the_compile_error(monkeypatch, threads):
    from torch_scan_hop.inductor.codegen import loop_kernel

    step, c0, xs = _rnn()
    source = loop_kernel._source
    monkeypatch.setattr(loop_kernel, "_source", lambda *a: source(*a) + "\n#error scan_steps_simulated_error\n")
    with warnings.catch_warnings(record=True) as caught, pytest.raises(Exception, match="scan_steps_simulated_error"):
        warnings.simplefilter("always")
        _compiled_forward(step, c0, xs, compile_threads=threads)
    assert not [w for w in caught if issubclass(w.category, kernel_build.KernelBindingWarning)]
