"""Real models through scan against the same model as a Python loop: values and gradients.

Every model is a module whose ``forward`` uses scan (or scan_layers) and whose
``loop`` is the same computation as a plain Python loop. Each runs in eager,
under torch.compile (inductor), through torch.export (inference) and on XLA (in a child
interpreter, see _isolated.py).
Gradients are of a fixed random weighting of every float output, w.r.t. the
parameters and the float inputs.
"""
import copy
import math
import os

import _isolated
import pytest
import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from conftest import assert_trees_close, reference_scan
from decoder import DecoderBlock, run_loop

from torch_scan_hop import scan, scan_layers

B, T, D = 2, 5, 16


class ScanModel(nn.Module):
    """forward: scan(self.step, init, xs); loop: the Python loop over the same step."""

    def forward(self, init, xs):
        return scan(self.step, init, xs)

    def loop(self, init, xs):
        return reference_scan(self.step, init, xs)


class Cell(ScanModel):
    def __init__(self, cell):
        super().__init__()
        self.cell = cell

    def step(self, h, x):
        if isinstance(self.cell, nn.LSTMCell):
            h, c = self.cell(x, h)
            return (h, c), h * c
        h = self.cell(x, h)
        return h, h.sum(-1)


def masks():
    causal = torch.ones(T, T, dtype=torch.bool).triu(1)  # True: may not attend
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[1, -2:] = True  # the second sequence has two padding positions at the end
    return causal, pad


class Encoder(ScanModel):
    """A universal-transformer-style encoder: one layer applied at every step."""

    def __init__(self, train):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(D, 4, 32, dropout=0.0 if train else 0.1, batch_first=True)
        self.train(train)
        causal, pad = masks()
        self.register_buffer("causal", causal)
        self.register_buffer("pad", pad)

    def step(self, h, x):
        h = self.layer(h + x, src_mask=self.causal, src_key_padding_mask=self.pad)
        return h, h.mean(1)


class Decoder(ScanModel):
    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerDecoderLayer(D, 4, 32, dropout=0.1, batch_first=True).eval()
        self.memory = nn.Parameter(torch.randn(B, T, D))
        causal, pad = masks()
        self.register_buffer("causal", causal)
        self.register_buffer("pad", pad)

    def step(self, h, x):
        h = self.layer(h + x, self.memory, tgt_mask=self.causal, memory_key_padding_mask=self.pad)
        return h, None


class MHA(ScanModel):
    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(D, 4, batch_first=True)
        self.register_buffer("pad", masks()[1])

    def step(self, h, kv):
        a, w = self.mha(h, kv, kv, key_padding_mask=self.pad, need_weights=True)
        return torch.tanh(h + a), w


class EinsumAttention(ScanModel):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Parameter(torch.randn(D, D) / math.sqrt(D)) for _ in range(3))
        self.register_buffer("causal", masks()[0])

    def step(self, h, x):
        q = torch.einsum("btd,de->bte", h, self.wq)
        k = torch.einsum("bsd,de->bse", h + x, self.wk)
        v = torch.einsum("bsd,de->bse", x, self.wv)
        s = torch.einsum("bte,bse->bts", q, k) / math.sqrt(D)
        a = torch.softmax(s.masked_fill(self.causal, float("-inf")), -1)
        return h + torch.einsum("bts,bse->bte", a, v), a.amax(-1)


class SelectiveScan(ScanModel):
    """Mamba-style: h = exp(delta A) h + delta B u, y = C h + D u, input-dependent delta, B, C."""

    def __init__(self, d=4, n=3):
        super().__init__()
        self.log_a = nn.Parameter(torch.randn(d, n) * 0.1)
        self.d_skip = nn.Parameter(torch.randn(d))
        self.proj = nn.Linear(d, 1 + 2 * n)

    def step(self, h, u):  # h (B, d, n), u (B, d)
        n = h.shape[-1]
        delta, b, c = torch.split(self.proj(u), [1, n, n], dim=-1)
        delta = nn.functional.softplus(delta)  # (B, 1)
        da = torch.exp(-delta[..., None] * torch.exp(self.log_a))  # (B, d, n)
        h = da * h + delta[..., None] * b[:, None, :] * u[..., None]
        return h, (h * c[:, None, :]).sum(-1) + self.d_skip * u


class RK4(ScanModel):
    """Classic 4th-order Runge-Kutta for dy/dt = tanh(y W + b); xs are the step sizes."""

    def __init__(self, n=4):
        super().__init__()
        self.lin = nn.Linear(n, n)

    def f(self, y):
        return torch.tanh(self.lin(y))

    def step(self, y, dt):
        k1 = self.f(y)
        k2 = self.f(y + dt / 2 * k1)
        k3 = self.f(y + dt / 2 * k2)
        k4 = self.f(y + dt * k3)
        y = y + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
        return y, y.norm(dim=-1)


class Kalman(ScanModel):
    """A linear-Gaussian Kalman filter: carry (mean, covariance), xs the observations; y the log-likelihood."""

    def __init__(self, n=3, m=2):  # m=2: the log-likelihood writes det(S) for a 2x2 S
        super().__init__()
        self.F = nn.Parameter(torch.eye(n) + 0.1 * torch.randn(n, n))
        self.H = nn.Parameter(torch.randn(m, n))
        self.lq, self.lr = nn.Parameter(0.3 * torch.randn(n, n)), nn.Parameter(0.3 * torch.randn(m, m))

    def step(self, carry, z):
        mu, P = carry
        n, m = mu.shape[-1], z.shape[-1]
        Q = self.lq @ self.lq.T + 1e-2 * torch.eye(n, dtype=mu.dtype, device=mu.device)
        R = self.lr @ self.lr.T + 1e-2 * torch.eye(m, dtype=mu.dtype, device=mu.device)
        mu, P = mu @ self.F.T, self.F @ P @ self.F.T + Q
        S = self.H @ P @ self.H.T + R
        S_inv = torch.linalg.inv(S)  # not linalg.solve: torch_xla has no XLA lowering for it
        K = (S_inv @ self.H @ P).transpose(-1, -2)  # P H^T S^-1 (S, P symmetric)
        innov = z - mu @ self.H.T
        mu = mu + (K @ innov[..., None]).squeeze(-1)
        P = (torch.eye(n, dtype=mu.dtype, device=mu.device) - K @ self.H) @ P
        ll = -0.5 * ((innov[..., None, :] @ S_inv @ innov[..., None]).squeeze((-1, -2))
                     + torch.log(S[..., 0, 0] * S[..., 1, 1] - S[..., 0, 1] * S[..., 1, 0]))  # logdet of 2x2 S
        # (torch.logdet has no backward on XLA tensors in torch_xla)
        return (mu, P), ll


class GPT(nn.Module):
    """A GPT-style stack of pre-norm decoder blocks through scan_layers, with a mask keyword."""

    def __init__(self, depth=3):
        super().__init__()
        self.layers = nn.ModuleList(DecoderBlock(D, 4) for _ in range(depth))

    def forward(self, h, mask):
        return scan_layers(self.layers, h, attn_mask=mask)

    def loop(self, h, mask):
        return run_loop(self.layers, h, attn_mask=mask)


def gpt_inputs():
    causal, pad = masks()
    return torch.randn(B, T, D, requires_grad=True), ~(causal | pad[:, None, None, :])  # (B, 1, T, T), True: attend


def seq(*shape, grad=True):
    return torch.randn(*shape).requires_grad_(grad)


L = 6
MODELS = {  # name -> (build the module, fresh inputs, dtype)
    "rnn_cell": (lambda: Cell(nn.RNNCell(D, D)), lambda: (seq(B, D), seq(L, B, D)), torch.float32),
    "lstm_cell": (lambda: Cell(nn.LSTMCell(D, D)), lambda: ((seq(B, D), seq(B, D)), seq(L, B, D)), torch.float32),
    "gru_cell": (lambda: Cell(nn.GRUCell(D, D)), lambda: (seq(B, D), seq(L, B, D, grad=False)), torch.float32),
    "encoder_eval": (lambda: Encoder(train=False), lambda: (seq(B, T, D), seq(3, B, T, D)), torch.float32),
    "encoder_train": (lambda: Encoder(train=True), lambda: (seq(B, T, D), seq(3, B, T, D)), torch.float32),
    "decoder_eval": (Decoder, lambda: (seq(B, T, D), seq(3, B, T, D)), torch.float32),
    "multihead_attention": (MHA, lambda: (seq(B, T, D), seq(3, B, T, D)), torch.float32),
    "einsum_attention": (EinsumAttention, lambda: (seq(B, T, D), seq(3, B, T, D)), torch.float64),
    "selective_scan": (SelectiveScan, lambda: (seq(B, 4, 3), seq(L, B, 4)), torch.float64),
    "rk4": (RK4, lambda: (seq(B, 4), torch.full((L,), 0.1).requires_grad_()), torch.float64),
    "kalman": (Kalman, lambda: ((seq(B, 3), torch.eye(3).expand(B, 3, 3).clone()), seq(L, B, 2)), torch.float64),
    "gpt_scan_layers": (GPT, gpt_inputs, torch.float32),
}


def build(name):
    make_model, make_inputs, dtype = MODELS[name]
    torch.manual_seed(0)
    model = make_model().to(dtype)
    inputs = pytree.tree_map(lambda t: t.detach().to(dtype).requires_grad_(t.requires_grad)
                             if t.is_floating_point() else t, make_inputs())
    return model, inputs


def fresh(inputs):
    return pytree.tree_map(lambda t: t.detach().clone().requires_grad_(t.requires_grad), inputs)


def floats(tree):
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def value_and_grads(model, fn, inputs):
    """fn(*inputs), and d(fixed random weighting of its float outputs)/d(parameters, float inputs)."""
    out = fn(*inputs)
    g = torch.Generator().manual_seed(1)
    loss = sum((t * torch.randn(t.shape, generator=g, dtype=torch.float64).to(t)).sum() for t in floats(out))
    targets = list(model.parameters()) + [t for t in floats(inputs) if t.requires_grad]
    return out, list(torch.autograd.grad(loss, targets, allow_unused=True, materialize_grads=True))


def tol(dtype):
    return dict(rtol=1e-7, atol=1e-9) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)


def want(name):
    model, inputs = build(name)
    return value_and_grads(model, model.loop, inputs)


@pytest.mark.parametrize("name", list(MODELS))
def test_eager(name):
    model, inputs = build(name)
    assert_trees_close(value_and_grads(model, model, inputs), want(name), **tol(MODELS[name][2]))


# inductor compiles forward and backward: 20-100 s per model on 2 cores, so the default run
# compiles a representative subset; SCAN_ZOO_FULL=1 compiles every model.
INDUCTOR = list(MODELS) if os.environ.get("SCAN_ZOO_FULL") else ["lstm_cell", "selective_scan", "kalman", "gpt_scan_layers"]


@pytest.mark.parametrize("name", INDUCTOR)
def test_inductor(name):
    torch._dynamo.reset()
    model, inputs = build(name)
    compiled = torch.compile(model, backend="inductor")
    got = value_and_grads(model, compiled, inputs)
    assert_trees_close(got, want(name), **tol(MODELS[name][2]))
    assert_trees_close(value_and_grads(model, compiled, fresh(inputs)), got, **tol(MODELS[name][2]))  # warm call


@pytest.mark.parametrize("name", list(MODELS))
def test_export(name):
    model, inputs = build(name)
    ep = torch.export.export(model, pytree.tree_map(torch.Tensor.detach, inputs))
    with torch.no_grad():
        got = ep.module()(*fresh(inputs))
        expected = model.loop(*inputs)
    assert_trees_close(got, expected, **tol(MODELS[name][2]))


@pytest.mark.parametrize("name", list(MODELS))
def test_xla(name):
    pytest.importorskip("torch_xla", reason="torch_xla is not installed")
    _isolated.call("test_model_zoo", "check_xla", name)  # in a child interpreter: a crash fails only this case


def check_xla(name):
    import torch_xla
    dev = torch_xla.device()
    model, inputs = build(name)
    model = copy.deepcopy(model).to(dev)
    inputs = pytree.tree_map(lambda t: t.detach().to(dev).requires_grad_(t.requires_grad), inputs)
    got = value_and_grads(model, model, inputs)
    torch_xla.sync()  # one graph for every output: each .cpu() alone would compile its own
    got = pytree.tree_map(lambda t: t if t is None else t.detach().cpu(), got)
    loose = dict(rtol=1e-6, atol=1e-8) if MODELS[name][2] == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    assert_trees_close(got, want(name), **loose)
