"""Four recurrences as transformers writes them, and the same loops written as ``scan``.

Shared by ``tests/differential/test_foreign_recurrences.py`` (values and float64 gradients of every
form against the library's own function) and ``benchmarks/recurrences.py`` (training steps), so the
tests check what the benchmark times. Each ``Recurrence`` has:

- ``inputs(B, T, D, device, dtype)``: the library function's tensor arguments, realistic in range
  (decays in (0, 1), Mamba's S4D-real ``A``), every float one a candidate for a gradient;
- ``library(**inputs)``: transformers' own function, called as it is (its sequential path), outputs
  as a tuple;
- ``forms``: the same computation with the library's loop written as one ``scan``; the code around
  the loop (discretization, gates, skips) is the library's, copied, since only the loop is replaced.

The bodies compute per step what the library computes, in its order and dtypes (RWKV's
``key.float()``, RG-LRU's accumulation dtype), and are pointwise in their carries where the
library's math is (RG-LRU's ``h = a*h + x``, RWKV's num/den/max, Mamba's ``h = dA*h + dBu``):
the bodies a fusing pass for pointwise carries is measured on. State dtypes: the library's float32,
or float64 for float64 inputs (the tests' gradients).
"""
import inspect
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from torch_scan_hop import scan


@dataclass
class Recurrence:
    name: str
    library_name: str  # the transformers function the forms are checked against
    inputs: object  # (B, T, D, device, dtype) -> {name: tensor}
    library: object  # (**inputs) -> tuple of tensors, or None when transformers lacks it
    forms: dict = field(default_factory=dict)  # form name -> (**inputs) -> the library's tuple


def state_dtype(dtype):
    """The library's accumulation dtype (float32) widened to float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _gen(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return lambda *shape: torch.randn(*shape, generator=g).to(device)


def _lib(module, name):
    """``module.name`` from transformers, unwrapped from hub-kernel decorators (so the torch code
    runs, not an installed mamba_ssm kernel); None when this transformers lacks it."""
    import importlib

    try:
        fn = getattr(importlib.import_module(f"transformers.models.{module}"), name, None)
    except ImportError:
        return None
    return None if fn is None else inspect.unwrap(fn)


# looked up once, here: torch.compile traces the callers below, and an import inside them breaks the graph
MAMBA_SELECTIVE_SCAN = _lib("mamba.modeling_mamba", "mamba_selective_scan")
RWKV_LINEAR_ATTENTION_CPU = _lib("rwkv.modeling_rwkv", "rwkv_linear_attention_cpu")
MLSTM_RECURRENT_SEQUENCE_NATIVE = _lib("xlstm.modeling_xlstm", "mlstm_recurrent_sequence_native")
MLSTM_RECURRENT_STEP_NATIVE = _lib("xlstm.modeling_xlstm", "mlstm_recurrent_step_native")
RGLRU = _lib("recurrent_gemma.modeling_recurrent_gemma", "RecurrentGemmaRglru")
RNN_SCAN = getattr(RGLRU, "_rnn_scan", None)


# ---- Mamba: mamba_selective_scan's sequential path (use_mambapy=False, use_associative_scan=False)

def mamba_inputs(B, T, D, device, dtype, N=16):
    r = _gen(device)
    a_log = torch.log(torch.arange(1, N + 1, dtype=torch.float64)).expand(D, N).to(device)
    return {"hidden_states": r(B, D, T).to(dtype), "dt": (0.5 * r(B, D, T) - 2).to(dtype),
            "A": (-torch.exp(a_log) * (1 + 0.1 * r(D, N))).to(dtype), "B": r(B, N, T).to(dtype),
            "C": r(B, N, T).to(dtype), "D": r(D).to(dtype), "z": r(B, D, T).to(dtype),
            "delta_bias": (0.1 * r(D)).to(dtype)}


def mamba_library(hidden_states, dt, A, B, C, D, z, delta_bias, **kw):
    return tuple(MAMBA_SELECTIVE_SCAN(hidden_states, dt, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=True,
                    return_last_state=True, use_mambapy=False, **kw))


def mamba_scan(hidden_states, dt, A, B, C, D, z, delta_bias, contraction="body"):
    """The library's function with its loop as a scan over T (xs sliced along their time dim).
    ``contraction="body"``: y = (h * C_t).sum(-1) per step, as the library's per-step matmul;
    ``"outside"``: the body returns h itself and the contraction over N runs once on all states."""
    input_dtype = hidden_states.dtype
    dt = F.softplus(dt + delta_bias.to(dt.dtype)[..., None])
    Bt, Ct = B.transpose(1, 2), C.transpose(1, 2)  # (batch, T, N)
    discrete_A = torch.exp(A[None, :, None, :] * dt[:, :, :, None])  # (batch, D, T, N)
    deltaB_u = dt[:, :, :, None] * Bt[:, None, :, :].float() * hidden_states[:, :, :, None].float()
    h0 = torch.zeros(hidden_states.shape[0], hidden_states.shape[1], A.shape[-1], dtype=input_dtype,
                     device=hidden_states.device)

    def step(h, x):
        dA, dBu, c = x  # (batch, D, N), (batch, D, N), (batch, 1, N)
        h = dA * h + dBu
        return h, ((h.to(input_dtype) * c).sum(-1) if contraction == "body" else h)

    h, ys = scan(step, h0, (discrete_A, deltaB_u, Ct[:, None]), dim=2)  # ys: (T, batch, D[, N])
    if contraction == "body":
        out = ys.permute(1, 2, 0)
    else:
        out = torch.einsum("tbdn,btn->bdt", ys.to(input_dtype), Ct)
    out = (out + hidden_states * D[None, :, None]) * F.silu(z)
    return out, h


# ---- RWKV: rwkv_linear_attention_cpu (wkv with num/den/max carried, output[:, t] written)

def rwkv_inputs(B, T, D, device, dtype):
    r = _gen(device, 1)
    return {"time_decay": (0.5 * r(D) - 1).to(dtype), "time_first": (0.5 * r(D)).to(dtype),
            "key": r(B, T, D).to(dtype), "value": r(B, T, D).to(dtype),
            "num": r(B, D).to(state_dtype(dtype)), "den": (1 + r(B, D).abs()).to(state_dtype(dtype)),
            "max": r(B, D).to(state_dtype(dtype))}


def rwkv_library(time_decay, time_first, key, value, num, den, max):  # noqa: A002 - the library's state name
    out, (num, den, max) = RWKV_LINEAR_ATTENTION_CPU(time_decay, time_first, key, value, state=[num, den, max],
                                                     return_state=True)
    return out, num, den, max


def _wkv_step(time_decay, time_first, out_dtype):
    """One step of the library's loop: the row it writes, and the state it carries on."""
    def step(num, den, mx, key, value):
        key = key.float()
        max_for_output = torch.maximum(mx, key + time_first)
        e1 = torch.exp(mx - max_for_output)
        e2 = torch.exp(key + time_first - max_for_output)
        row = ((e1 * num + e2 * value) / (e1 * den + e2)).to(out_dtype)
        max_for_state = torch.maximum(mx + time_decay, key)
        e1 = torch.exp(mx + time_decay - max_for_state)
        e2 = torch.exp(key - max_for_state)
        return (e1 * num + e2 * value, e1 * den + e2, max_for_state), row
    return step


def rwkv_scan(time_decay, time_first, key, value, num, den, max, write=False):  # noqa: A002
    """``write=False``: each step's row is a y; ``True``: the library's ``output[:, t] = row`` into a
    carried buffer, ``t`` from ``with_index``."""
    wkv = _wkv_step(-torch.exp(time_decay), time_first, key.dtype)
    if not write:
        def step(carry, x):
            carry, row = wkv(*carry, *x)
            return carry, row
        (num, den, max), rows = scan(step, (num, den, max), (key, value), dim=1)
        return rows.transpose(0, 1), num, den, max

    def write_step(carry, x, t):
        *state, out = carry
        state, row = wkv(*state, *x)
        out[:, t] = row
        return (*state, out), None
    (num, den, max, out), _ = scan(write_step, (num, den, max, torch.zeros_like(key)), (key, value), dim=1,
                                   with_index=True)
    return out, num, den, max


# ---- xLSTM: mlstm_recurrent_sequence_native; our body IS the library's mlstm_recurrent_step_native

def xlstm_inputs(B, T, D, device, dtype, heads=4):
    r, dh = _gen(device, 2), D // heads
    return {"query": r(B, heads, T, dh).to(dtype), "key": r(B, heads, T, dh).to(dtype),
            "value": r(B, heads, T, dh).to(dtype), "igate": r(B, heads, T).to(dtype),
            "fgate": (r(B, heads, T) + 3).to(dtype)}


def xlstm_library(query, key, value, igate, fgate):
    h, (c, n, m) = MLSTM_RECURRENT_SEQUENCE_NATIVE(query, key, value, igate, fgate, return_last_states=True,
                      dtype_state=state_dtype(query.dtype))
    return h, c, n, m


def xlstm_scan(query, key, value, igate, fgate):
    B, NH, _, DHQK = query.shape
    dtype_state = state_dtype(query.dtype)
    zeros = lambda *s: torch.zeros(*s, dtype=dtype_state, device=query.device)  # noqa: E731 - the library's init
    init = (zeros(B, NH, DHQK, value.shape[-1]), zeros(B, NH, DHQK), zeros(B, NH, 1))

    def step(carry, x):
        q, k, v, i, f = x
        h, carry = MLSTM_RECURRENT_STEP_NATIVE(q, k, v, i[..., None], f[..., None], *carry, dtype_state=dtype_state)
        return carry, h

    (c, n, m), hs = scan(step, init, (query, key, value, igate, fgate), dim=2)
    return hs.movedim(0, 2), c, n, m


# ---- RecurrentGemma: RecurrentGemmaRglru._rnn_scan (h = a*h + x, out[:, t] written)

def rglru_inputs(B, T, D, device, dtype):
    r = _gen(device, 3)
    reset = torch.zeros(B, T, 1, dtype=torch.bool)
    reset[:, 0] = True
    reset[0, T // 2] = True  # a document boundary inside the first sequence
    return {"hidden_states": r(B, T, D).to(dtype), "recurrent_gate": torch.sigmoid(r(B, T, D) + 2).to(dtype),
            "reset": reset.to(device), "recurrent_states": r(B, D).to(state_dtype(dtype))}


def rglru_library(hidden_states, recurrent_gate, reset, recurrent_states):
    # a method that reads nothing of self: called on None rather than on a module built for the call
    return tuple(RNN_SCAN(None, hidden_states, recurrent_gate, reset, recurrent_states,
                                               acc_dtype=state_dtype(hidden_states.dtype)))


def rglru_scan(hidden_states, recurrent_gate, reset, recurrent_states, write=False):
    """``write=False``: the row a y; ``True``: ``out[:, t] = row`` into a carried buffer, as the library."""
    acc_dtype, out_dtype = state_dtype(hidden_states.dtype), hidden_states.dtype
    recurrent_gate = recurrent_gate * ~reset

    def lru(h, a, x):
        h = a.type(acc_dtype) * h + x.type(acc_dtype)
        return h, h.type(out_dtype)

    if not write:
        h, rows = scan(lambda h, x: lru(h, *x), recurrent_states, (recurrent_gate, hidden_states), dim=1)
        return rows.transpose(0, 1), h

    def write_step(carry, x, t):
        h, out = carry
        h, row = lru(h, *x)
        out[:, t] = row
        return (h, out), None
    (h, out), _ = scan(write_step, (recurrent_states, torch.zeros_like(hidden_states)),
                       (recurrent_gate, hidden_states), dim=1, with_index=True)
    return out, h


def _available(caller, *needs):
    return caller if all(n is not None for n in needs) else None


RECURRENCES = {
    "mamba": Recurrence("mamba", "mamba_selective_scan", mamba_inputs,
                        _available(mamba_library, MAMBA_SELECTIVE_SCAN),
                        {"scan": mamba_scan, "scan_states": lambda **i: mamba_scan(**i, contraction="outside")}),
    "rwkv": Recurrence("rwkv", "rwkv_linear_attention_cpu", rwkv_inputs,
                       _available(rwkv_library, RWKV_LINEAR_ATTENTION_CPU),
                       {"scan": rwkv_scan, "scan_write": lambda **i: rwkv_scan(**i, write=True)}),
    "xlstm": Recurrence("xlstm", "mlstm_recurrent_sequence_native", xlstm_inputs,
                        _available(xlstm_library, MLSTM_RECURRENT_SEQUENCE_NATIVE,
                                   MLSTM_RECURRENT_STEP_NATIVE),
                        {"scan": xlstm_scan}),
    "rglru": Recurrence("rglru", "RecurrentGemmaRglru._rnn_scan", rglru_inputs,
                        _available(rglru_library, RNN_SCAN),
                        {"scan": rglru_scan, "scan_write": lambda **i: rglru_scan(**i, write=True)}),
}
