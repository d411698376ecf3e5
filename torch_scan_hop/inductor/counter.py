"""The loop counter of a scan on an accelerator: two library operators, no generated kernel.

A scan's while_loop counts its steps on the CPU (reading a device counter would sync the
device every step). Written as ATen ops (``torch.zeros``, ``add_``), inductor generates
C++ kernels for them, and a graph whose every other kernel is Triton then pays for the C++
toolchain's first use in the process: ISA probes and builds, ~50 s of a ~55 s first call of
a tanh RNN scan on an H200 (torch 2.11), against 3.7 s for the compiled Python loop. As
these operators inductor calls them (fallback kernels) and builds nothing.
``codegen.python_text.drop_counter_steps`` drops the step's call in loops that run as ``for`` loops, whose
index is the Python loop variable.
"""
import torch

from . import cpp_wrapper

_LIB = torch.library.Library("torch_scan_hop", "FRAGMENT")
_LIB.define("loop_counter() -> Tensor", tags=(torch.Tag.pt2_compliant_tag,))
_LIB.define("count_step(Tensor(a!) counter) -> ()", tags=(torch.Tag.pt2_compliant_tag,))


def _loop_counter():
    return torch.zeros([], dtype=torch.int64)


def _count_step(counter):
    counter.add_(1)


_LIB.impl("loop_counter", _loop_counter, "CompositeExplicitAutograd")
_LIB.impl("count_step", _count_step, "CompositeExplicitAutograd")


@torch.library.register_fake("torch_scan_hop::loop_counter", lib=_LIB)
def _(*_args):
    return torch.empty([], dtype=torch.int64)


@torch.library.register_fake("torch_scan_hop::count_step", lib=_LIB)
def _(counter):
    return None


def uses_operators(tensors):
    """Whether a scan over ``tensors`` counts with the operators: when none is on the CPU
    (where the body's kernels are C++ anyway, and a generated kernel is the cheaper step)
    and the wrapper is Python (a C++ wrapper or an AOTInductor package builds C++ anyway,
    and a package must run where this library is not imported)."""
    devices = {t.device.type for t in tensors if isinstance(t, torch.Tensor)}
    return bool(devices) and "cpu" not in devices and not cpp_wrapper.cpp_wrapper_active()


def new_counter(operators):
    return torch.ops.torch_scan_hop.loop_counter.default() if operators else torch.zeros([], dtype=torch.int64)


def step(counter, operators):
    if operators:
        torch.ops.torch_scan_hop.count_step.default(counter)
    else:
        counter.add_(1)
