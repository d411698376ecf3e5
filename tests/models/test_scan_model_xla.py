"""scan_model on XLA (CPU): Llama and Gemma 3 (7 layers: 2 blocks of 2 sliding + 1 full, then 1),
logits and every gradient against the unscanned twin on XLA, eager XLA and openxla; with ``unroll=1``
the scans are XLA Whiles.

Each case runs in the isolated child interpreter (a crash in XLA fails that case, not the pytest
worker), and each step's outputs are materialized by ONE ``torch_xla.sync()``: ``.cpu()`` on each
gradient of a pending lazy graph compiles one graph per tensor (tens of LLVM compiles per case)."""
import copy

import _isolated
import pytest
import torch

pytest.importorskip("torch_xla")
pytest.importorskip("transformers", minversion="5")


@pytest.mark.parametrize("family, depth", [("llama", 4), ("gemma3", 7)])
@pytest.mark.parametrize("compiled", [False, True], ids=["xla", "openxla"])
def test_training_step_on_xla(family, depth, compiled):
    _isolated.call("test_scan_model_xla", "check_training_step", family, depth, compiled)


def step_on_cpu(model, f, tokens, expect_while=False):
    """Logits and every parameter's gradient of one training step (on XLA: in one graph), returned
    on the CPU. Also the SPMD check's (``spmd_hf_cases``)."""
    import torch_xla

    model.train()
    logits, loss = f(model, tokens)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    if expect_while:  # the lazy graph is still pending: its HLO holds the scans
        assert "while" in torch_xla._XLAC._get_xla_tensors_hlo([logits, *grads])
    torch_xla.sync()
    return logits.cpu(), [g.cpu() for g in grads]


def check_training_step(family, depth, compiled):
    import torch_xla
    from hf_families import build, ids, logits_and_loss

    from torch_scan_hop import scan_model

    torch.manual_seed(0)
    dev = torch_xla.device()
    ref = build(family, depth, full_every=3)  # Gemma 3: 2 blocks of (2 sliding + 1 full), then 1
    model = scan_model(copy.deepcopy(ref), unroll=1).to(dev)
    # the twin on XLA: Gemma 3's embedding gradient on XLA differs from the CPU's by ~0.2, loop or scan
    want_logits, want_grads = step_on_cpu(ref.to(dev), logits_and_loss, ids().to(dev))
    f = torch.compile(logits_and_loss, backend="openxla") if compiled else logits_and_loss
    logits, grads = step_on_cpu(model, f, ids().to(dev), expect_while=not compiled)
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-5)
    assert len(grads) == len(want_grads)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
