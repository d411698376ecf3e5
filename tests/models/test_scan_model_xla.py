"""scan_model on XLA (CPU): Llama and Gemma 3 (8 layers: runs of sliding layers around a full one),
logits and every gradient against the unscanned twin on the CPU, eager XLA and openxla; with
``unroll=1`` the scans are XLA Whiles."""
import copy

import pytest
import torch
from hf_families import build, ids, logits_and_loss

from torch_scan_hop import scan_model

torch_xla = pytest.importorskip("torch_xla")
pytest.importorskip("transformers", minversion="5")


def _step(model, f, tokens):
    model.train()
    logits, loss = f(model, tokens)
    return logits, torch.autograd.grad(loss, list(model.parameters()))


@pytest.mark.parametrize("family, depth", [("llama", 4), ("gemma3", 8)])
@pytest.mark.parametrize("compiled", [False, True], ids=["xla", "openxla"])
def test_training_step_on_xla(family, depth, compiled):
    torch.manual_seed(0)
    ref = build(family, depth)
    model = scan_model(copy.deepcopy(ref), unroll=1).to(torch_xla.device())
    # the twin on XLA: Gemma 3's embedding gradient on XLA differs from the CPU's by ~0.2, loop or scan
    want = [t.cpu() if isinstance(t, torch.Tensor) else [g.cpu() for g in t]
            for t in _step(ref.to(torch_xla.device()), logits_and_loss, ids().to(torch_xla.device()))]
    f = torch.compile(logits_and_loss, backend="openxla") if compiled else logits_and_loss
    logits, grads = _step(model, f, ids().to(torch_xla.device()))
    if not compiled:  # the lazy graph is still pending: its HLO holds the scans
        assert "while" in torch_xla._XLAC._get_xla_tensors_hlo([logits, *grads])
    torch.testing.assert_close(logits.cpu(), want[0], rtol=1e-4, atol=1e-5)
    for g, w in zip(grads, want[1]):
        torch.testing.assert_close(g.cpu(), w, rtol=1e-4, atol=1e-4)
