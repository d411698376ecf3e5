"""XLA: layout-sensitive ops in a scan body (views, transposes, einsum) match the Python loop.

Regression: the body used to be staged out with functionalization switched
off (the Functionalize rule's redispatch), where torch_xla composes chains of
views wrongly; einsum's permute -> view -> bmm came out transposed.
"""
import math

import pytest
import torch
from xla_util import assert_matches_loop

B, S, K, H, T = 2, 3, 4, 5, 5


def _closures():
    g = torch.Generator().manual_seed(7)
    return [torch.randn(K, K, generator=g) * 0.4, torch.randn(K, H, generator=g) * 0.4]


def _inputs():
    g = torch.Generator().manual_seed(8)
    init = torch.randn(B, S, K, generator=g) * 0.5
    xs = {"a": torch.randn(T, B, S, K, generator=g) * 0.5, "m": torch.randn(T, B, K, K, generator=g) * 0.5}
    return init, xs


def einsum_batched(w, v):
    def body(c, x):
        y = torch.einsum("bsk,bkh->bsh", c, x["m"])
        return torch.tanh(y), y
    return body


def einsum_attention(w, v):
    def body(c, x):
        scores = torch.einsum("bsk,btk->bst", c, x["a"]) / math.sqrt(K)
        out = torch.einsum("bst,btk->bsk", scores.softmax(-1), x["a"])
        return c + out, scores
    return body


def einsum_transposed_closure(w, v):
    def body(c, x):
        y = torch.einsum("bsk,hk->bsh", c, v.t())
        return torch.tanh(c + torch.einsum("bsh,kh->bsk", y, v)), y
    return body


def einsum_permutation(w, v):
    def body(c, x):
        return c * 0.9 + x["a"], torch.einsum("bsk->kbs", c)
    return body


def transposed_output(w, v):
    def body(c, x):
        return c + x["a"], c.transpose(1, 2)
    return body


def permute_reshape(w, v):
    def body(c, x):
        return c.permute(0, 2, 1).reshape(B, S, K) * 0.5 + x["a"], c.permute(2, 0, 1).contiguous()
    return body


def matmul_transposed_closures(w, v):
    def body(c, x):
        return torch.tanh(c @ w.T.T + x["a"]), (c @ w.mT).mT @ c
    return body


def linear(w, v):
    def body(c, x):
        return torch.nn.functional.linear(c, w) + x["a"], torch.nn.functional.linear(c.unsqueeze(1), v.t()).squeeze(1)
    return body


def expand(w, v):
    def body(c, x):
        return c + x["a"][:1].expand(B, S, K), x["a"].sum(0).expand(2, S, K) * c.mean()
    return body


def strided_views(w, v):
    def body(c, x):
        return c + x["a"].flip(1).as_strided((B, S, K), (S * K, K, 1)), c.diagonal(0, 1, 2)
    return body


def narrow_select(w, v):
    def body(c, x):
        return c * 0.5 + x["m"].narrow(1, 0, S), c.select(1, 0).t()
    return body


def bmm_transposed(w, v):
    def body(c, x):
        return torch.tanh(torch.bmm(c, x["m"].transpose(1, 2))), torch.bmm(x["m"].mT, c.mT)
    return body


def chunk_cat(w, v):
    def body(c, x):
        return c + torch.cat(x["a"].chunk(3, 1)[::-1], 1), torch.stack(c.unbind(2), 0)
    return body


BODIES = [einsum_batched, einsum_attention, einsum_transposed_closure, einsum_permutation, transposed_output,
          permute_reshape, matmul_transposed_closures, linear, expand, strided_views, narrow_select,
          bmm_transposed, chunk_cat]


@pytest.mark.parametrize("make_body", BODIES, ids=lambda f: f.__name__)
def test_values_and_grads_match_loop(make_body):
    init, xs = _inputs()
    assert_matches_loop(make_body, _closures(), init, xs, grad=True, atol=1e-4, rtol=1e-4)


def test_einsum_matches_loop_on_xla_tensors():
    init, xs = _inputs()
    assert_matches_loop(einsum_batched, _closures(), init, xs, grad=True, loops=("xla",), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("make_body", [einsum_attention, matmul_transposed_closures], ids=lambda f: f.__name__)
def test_reverse_values_and_grads_match_loop(make_body):
    init, xs = _inputs()
    assert_matches_loop(make_body, _closures(), init, xs, grad=True, reverse=True, unroll=2, atol=1e-4, rtol=1e-4)


def attention_block(wq, wk, wv, wo, w1, w2):
    """A pre-norm transformer block with einsum projections; the carry is the residual stream."""
    def body(h, x):
        z = torch.nn.functional.layer_norm(h, (h.shape[-1],))
        q, k, v = (torch.einsum("bsd,de->bse", z, w) for w in (wq, wk, wv))
        att = torch.einsum("bqd,bkd->bqk", q, k).div(math.sqrt(q.shape[-1])).softmax(-1)
        h = h + torch.einsum("bqk,bkd,de->bqe", att, v, wo) + x
        h = h + torch.relu(torch.nn.functional.layer_norm(h, (h.shape[-1],)) @ w1) @ w2
        return h, att
    return body


def test_attention_block_values_and_grads_match_loop():
    g = torch.Generator().manual_seed(3)
    d = 8
    weights = [torch.randn(d, d, generator=g) * 0.3 for _ in range(4)]
    weights += [torch.randn(d, 2 * d, generator=g) * 0.3, torch.randn(2 * d, d, generator=g) * 0.3]
    init, xs = torch.randn(2, 3, d, generator=g), torch.randn(4, 2, 3, d, generator=g) * 0.1
    assert_matches_loop(attention_block, weights, init, xs, grad=True, atol=1e-4, rtol=1e-4)
