"""Recurrences as transformers writes them, against the same loops written as ``scan``.

Mamba's selective scan (``mamba_selective_scan``'s sequential loop), RWKV's wkv
(``rwkv_linear_attention_cpu``), xLSTM's mLSTM (``mlstm_recurrent_sequence_native``; our body is the
library's own ``mlstm_recurrent_step_native``) and RecurrentGemma's RG-LRU (``_rnn_scan``): each scan
form of ``tests/support/foreign_recurrences.py`` (the module ``benchmarks/recurrences.py`` times) against the library's function
called directly, values and the gradients of a fixed random weighting of every output w.r.t. every
float input, in float64; ``gradcheck`` on the smallest sizes; under ``torch.compile`` (inductor,
fullgraph) forward and backward in float32. CUDA cases run where a GPU is (TF32 off).
"""
import os

import pytest
import torch

pytest.importorskip("transformers")
from foreign_recurrences import RECURRENCES  # noqa: E402  (tests/support, on the path: pyproject)

B, T, D = 2, 5, 8
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]
FORMS = [(name, form) for name, rec in RECURRENCES.items() for form in rec.forms]
# compiled on CPU: the "scan" form of each (~35 s in all on 2 cores, cold inductor cache); the other forms
# (written rows, Mamba's states) with SCAN_FOREIGN_FULL=1 (by hand: 7 passed, 2026-11-30). On CUDA: every form.
FULL = os.environ.get("SCAN_FOREIGN_FULL") == "1"


@pytest.fixture(params=DEVICES)
def device(request, monkeypatch):
    """The device; on CUDA with TF32 off, so float32 matmuls round as the CPU's do."""
    if request.param == "cuda":
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    return request.param


def _recurrence(name):
    rec = RECURRENCES[name]
    if rec.library is None:
        pytest.skip(f"this transformers has no {rec.library_name}")
    return rec


def _inputs(rec, device, dtype, b=B, t=T, d=D):
    """The library's arguments, fresh leaves: the float ones require grad."""
    return {k: v.detach().clone().requires_grad_(v.is_floating_point())
            for k, v in rec.inputs(b, t, d, device, dtype).items()}


def _values_and_grads(fn, inputs):
    out = fn(**inputs)
    g = torch.Generator().manual_seed(1)
    loss = sum((o * torch.randn(o.shape, generator=g, dtype=torch.float64).to(o)).sum() for o in out)
    leaves = [v for v in inputs.values() if v.requires_grad]
    grads = torch.autograd.grad(loss, leaves, allow_unused=True, materialize_grads=True)
    return [o.detach() for o in out], list(grads)


def _assert_close(got, want, **tol):
    pairs = [("output", g, w) for g, w in zip(got[0], want[0])] + [("grad", g, w) for g, w in zip(got[1], want[1])]
    for what, g, w in pairs:
        assert (g.dtype, g.shape) == (w.dtype, w.shape), f"{what}: {g.dtype}{tuple(g.shape)} vs {w.dtype}{tuple(w.shape)}"
        torch.testing.assert_close(g, w, **tol)


@pytest.mark.parametrize("name,form", FORMS)
def test_values_and_grads_float64(name, form, device):
    rec = _recurrence(name)
    inputs = _inputs(rec, device, torch.float64)
    _assert_close(_values_and_grads(rec.forms[form], inputs), _values_and_grads(rec.library, inputs),
                  rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name,form", FORMS)
def test_values_float32(name, form, device):
    rec = _recurrence(name)
    inputs = _inputs(rec, device, torch.float32)
    with torch.no_grad():
        got, want = rec.forms[form](**inputs), rec.library(**inputs)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


# not mamba, rwkv: the library rounds deltaB_u (mamba), the key (rwkv) to float32 (`.float()`) in float64 too
@pytest.mark.parametrize("name", ["xlstm", "rglru"])
def test_gradcheck(name, device):
    rec = _recurrence(name)
    inputs = _inputs(rec, device, torch.float64, b=1, t=3, d=4)
    names = [k for k, v in inputs.items() if v.requires_grad]

    def fn(*floats):
        return rec.forms["scan"](**{**inputs, **dict(zip(names, floats))})
    assert torch.autograd.gradcheck(fn, [inputs[k] for k in names])


@pytest.mark.parametrize("name,form", FORMS)
def test_compiled_against_library_loop(name, form, device):
    """Inductor, fullgraph: forward and backward of the compiled scan form against the library's
    eager loop, float32."""
    rec = _recurrence(name)
    if device == "cpu" and form != "scan" and not FULL:
        pytest.skip("compiled on CPU with SCAN_FOREIGN_FULL=1 (CI time)")
    torch._dynamo.reset()
    compiled = torch.compile(rec.forms[form], backend="inductor", fullgraph=True)
    inputs = _inputs(rec, device, torch.float32)
    _assert_close(_values_and_grads(compiled, inputs), _values_and_grads(rec.library, inputs),
                  rtol=1e-4, atol=1e-5)
