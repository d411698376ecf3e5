"""Hugging Face layers through ``scan_layers`` on a mesh, for ``_distributed_checks.hf_layers_sharded``
and ``hf_layers_fsdp_tensor_parallel`` (run on every rank of the group): tiny random configs
(``test_hf_layers.build``: the keyword inputs the model itself gives its layer 0), sharded by FSDP2
(``fully_shard`` per layer and on the stack), by tensor parallel as a Llama-style trainer shards them
(q/k/v and gate/up column-wise, o and down row-wise), or by both on a (dp, tp) mesh, against the
model's own loop over an identically sharded copy: the loss of every output, the hidden state's
gradient and every parameter's (full) gradient.
"""
import copy

import test_hf_layers as hf
import torch
import torch.utils._pytree as pytree
from _layers_random import full, shard
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

_TP_PLAN = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}


def _loss_and_grads(stack, run, h, tensors):
    h = h.detach().clone().requires_grad_()
    tensors = pytree.tree_map(lambda t: t.detach().clone().requires_grad_(t.requires_grad), tensors)
    out = run(h, tensors)
    loss = sum(full(t).square().sum() for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
    loss.backward()
    return loss.detach(), h.grad, {name: full(p.grad) for name, p in stack.named_parameters()}


def run_case(name, how, mode, mesh, compiled):
    """``name``: a model ``test_hf_layers.build`` knows ("llama_tp" for tensor parallel); ``how``: "fsdp", "tp" or
    "fsdp+tp" (``mesh`` 2-D); ``mode``: "eager" or a torch.compile backend (``compiled(f, dynamic, backend)`` compiles)."""
    stack, (h, tensors), _ = hf.build(name)
    ref = shard(copy.deepcopy(stack), how, mesh, plan=_TP_PLAN)
    stack = shard(stack, how, mesh, plan=_TP_PLAN)
    run = stack if mode == "eager" else compiled(stack, False, mode)
    got, want = _loss_and_grads(stack, run, h, tensors), _loss_and_grads(ref, ref.loop, h, tensors)
    what = f"{name} {how} {mode}"
    torch.testing.assert_close(got[:2], want[:2], rtol=1e-4, atol=1e-5, msg=lambda m: f"{what} loss / input grad: {m}")
    assert got[2].keys() == want[2].keys(), (what, got[2].keys(), want[2].keys())
    for key, g in got[2].items():
        torch.testing.assert_close(g, want[2][key], rtol=1e-4, atol=1e-5, msg=lambda m, k=key: f"{what} grad of {k}: {m}")


def run_model_case(family, mode, mesh, recording_backend, scan_nodes):
    """``scan_model`` on a whole causal LM whose decoder layers and root FSDP2 shards (``fully_shard``
    per layer, then on the model), against the model's own loop over an identically sharded copy:
    the loss and every parameter's full gradient; compiled, the forward graph holds scan nodes."""

    from hf_families import build, logits_and_loss  # noqa: PLC0415

    from torch_scan_hop import scan_model  # noqa: PLC0415

    torch.manual_seed(0)
    model = build(family)
    ref = copy.deepcopy(model)
    for m in (ref, model):
        for layer in m.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
    scan_model(model)
    graphs, backend = recording_backend()
    run = logits_and_loss if mode == "eager" else torch.compile(logits_and_loss, backend=backend)
    got, want = _model_loss_and_grads(model, run), _model_loss_and_grads(ref, logits_and_loss)
    what = f"scan_model {family} fsdp {mode}"
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5, msg=lambda m: f"{what} loss: {m}")
    for key, g in got[1].items():
        torch.testing.assert_close(g, want[1][key], rtol=1e-4, atol=1e-5, msg=lambda m, k=key: f"{what} grad of {k}: {m}")
    if mode != "eager":
        assert sum(len(scan_nodes(gm)) for gm in graphs["fw"]) >= 1, f"{what}: no scan in the compiled forward"


def _model_loss_and_grads(model, run):
    from hf_families import ids  # noqa: PLC0415

    model.train()
    _, loss = run(model, ids())
    loss.backward()
    return loss.detach(), {name: full(p.grad) for name, p in model.named_parameters()}
