"""stack_layers, differentially: random stacks, freeze patterns, gradient hooks and ways of asking
for gradients (backward twice, optimizer steps, autograd.grad, backward(inputs=)), each checked
against the same Python loop over an unstacked deep copy: values, gradients and updated weights."""
import copy
import random

import pytest
import torch
from conftest import assert_trees_close
from decoder import Calling, run_loop

from torch_scan_hop import scan_layers, stack_layers


class Block(torch.nn.Module):
    def __init__(self, d, bias, norm):
        super().__init__()
        self.lin = torch.nn.Linear(d, d, bias=bias)
        self.norm = torch.nn.LayerNorm(d) if norm else None
        self.gate = torch.nn.Parameter(torch.randn(d))

    def forward(self, h):
        z = h if self.norm is None else self.norm(h)
        return h + torch.tanh(self.lin(z)) * self.gate


def random_pair(rng, seed):
    """A random stack (float64) and its stacked deep copy, with the same random frozen parameters
    (none, some or all layers of a name) and, maybe, one gradient-scaling hook on both."""
    torch.manual_seed(seed)
    d, depth, bias, norm = rng.choice([3, 5]), rng.randint(1, 5), rng.random() < 0.7, rng.random() < 0.6
    plain = torch.nn.ModuleList(Block(d, bias, norm) for _ in range(depth)).double()
    layers = stack_layers(copy.deepcopy(plain))
    names = [n for n, _ in plain[0].named_parameters()]
    for name in names:
        how = rng.choice(["none", "none", "some", "all"])
        for i in range(depth):
            if how == "all" or (how == "some" and rng.random() < 0.5):
                for model in (plain, layers):
                    model[i].get_parameter(name).requires_grad_(False)
    if rng.random() < 0.4:
        i, name, k = rng.randrange(depth), rng.choice(names), rng.choice([2.0, -1.0])
        for model in (plain, layers):
            p = model[i].get_parameter(name)
            if p.requires_grad:
                p.register_hook(lambda g, k=k: g * k)
    return plain, layers, d


def grads(model):
    return [p.grad for p in model.parameters()]


def optimizer(kind, model):
    params = list(model.parameters())
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01, foreach=True)


def check_training(fn, plain, layers, x, steps, opt_kind):
    """``steps`` backward calls (gradients accumulate without an optimizer), or optimizer steps."""
    opts = None if opt_kind is None else (optimizer(opt_kind, plain), optimizer(opt_kind, layers))
    for _ in range(steps):
        xs, xl = (x.detach().clone().requires_grad_(x.requires_grad) for _ in range(2))
        got, want = fn(layers, xs), run_loop(plain, xl)
        assert_trees_close(got, want, atol=1e-9, rtol=1e-7)
        if not want.requires_grad:
            assert not got.requires_grad
            return
        got.pow(2).sum().backward()
        want.pow(2).sum().backward()
        assert_trees_close((grads(layers), xs.grad), (grads(plain), xl.grad), atol=1e-9, rtol=1e-7)
        if opts is not None:
            for opt in opts:
                opt.step()
                opt.zero_grad()
            assert_trees_close(list(layers.parameters()), list(plain.parameters()), atol=1e-9, rtol=1e-7)


def check_chosen_gradients(fn, plain, layers, x, rng, how):
    """``autograd.grad`` or ``backward(inputs=)`` of a random subset of the layers' parameters."""
    trainable = [i for i, p in enumerate(plain.parameters()) if p.requires_grad]
    if not trainable:
        return
    chosen = rng.sample(trainable, rng.randint(1, len(trainable)))

    def pick(model):
        params = list(model.parameters())
        return [params[i] for i in chosen]

    got, want = fn(layers, x).pow(2).sum(), run_loop(plain, x).pow(2).sum()
    if how == "grad":
        assert_trees_close(torch.autograd.grad(got, pick(layers)), torch.autograd.grad(want, pick(plain)),
                           atol=1e-9, rtol=1e-7)
    else:
        got.backward(inputs=pick(layers))
        want.backward(inputs=pick(plain))
        assert_trees_close(grads(layers), grads(plain), atol=1e-9, rtol=1e-7)


@pytest.mark.parametrize("seed", range(12))
def test_random_stacks_match_the_loop(seed):
    rng = random.Random(seed)
    plain, layers, d = random_pair(rng, seed)
    backend = "inductor" if seed % 6 == 5 else "aot_eager"
    torch._dynamo.reset()
    fn = torch.compile(scan_layers, backend=backend)
    x = torch.randn(2, d, dtype=torch.float64, requires_grad=rng.random() < 0.5)
    how = ["backward", "accumulate", "sgd", "adamw", "grad", "inputs"][seed % 6]
    if how in ("grad", "inputs"):
        check_chosen_gradients(fn, plain, layers, x, rng, how)
    else:
        steps = 1 if how == "backward" else 2
        check_training(fn, plain, layers, x, steps, how if how in ("sgd", "adamw") else None)


def _fresh(rng, like):
    return torch.randn(like.shape, dtype=like.dtype, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))


def _change(rng, plain, layers):
    """One random change of a layer's parameters made to both models alike, between compiled
    calls: a submodule replaced, a Parameter registered in place of one, a Parameter written
    straight into a module's ``_parameters`` (no registration hook sees it), a restack (the
    stacked copy only), or nothing. Returns its name."""
    depth = len(plain)
    how, i = rng.choice(["submodule", "register", "dict", "restack", "none"]), rng.randrange(depth)
    if how == "submodule":
        lin = torch.nn.Linear(plain[i].lin.in_features, plain[i].lin.out_features, bias=plain[i].lin.bias is not None)
        lin = lin.double()
        plain[i].lin, layers[i].lin = lin, copy.deepcopy(lin)
    elif how in ("register", "dict"):
        new = _fresh(rng, plain[i].gate)
        for model in (plain, layers):
            if how == "register":
                model[i].gate = torch.nn.Parameter(new.clone())
            else:
                model[i]._parameters["gate"] = torch.nn.Parameter(new.clone())
    elif how == "restack":
        layers.restack()
    return how


# 10-15 s each: six seeds that draw every kind of change (_change), restacks twice in a row in 6, none in 7
@pytest.mark.parametrize("seed", [0, 1, 2, 4, 6, 7])
def test_random_parameter_changes_between_compiled_calls_match_the_loop(seed):
    """A compiled scan over stacked storage, then calls with random changes of the layers'
    parameters (``_change``) and random ``torch.func.functional_call`` swaps of some parameters
    around the compiled model, or with none (the stacked path again), each call checked against
    the loop (values and gradients): the compiled code must notice every change (its guards) and
    never scan a stale stack."""
    rng = random.Random(1000 + seed)
    plain, layers, d = random_pair(rng, seed)
    torch._dynamo.reset()
    compiled = Calling(layers, scan_layers)
    compiled.compile(backend="aot_eager")
    reference = Calling(plain, run_loop)
    x = torch.randn(2, d, dtype=torch.float64)
    for step in range(5):  # the first call compiles the stacked path; later ones change things or not
        plain_call = step == 0 or rng.random() < 0.4
        if not plain_call:
            _change(rng, plain, layers)
        names = [n for n, _ in reference.named_parameters()]
        swapped = [] if plain_call else rng.sample(names, rng.randint(0, min(3, len(names))))
        news = {n: _fresh(rng, reference.get_parameter(n)) for n in swapped}
        kind = rng.choice([torch.Tensor.requires_grad_, torch.nn.Parameter])
        args = [{n: kind(v.clone()) for n, v in news.items()} for _ in range(2)]
        outs = [torch.func.functional_call(m, a, (x,)) for m, a in ((compiled, args[0]), (reference, args[1]))]
        assert_trees_close(outs[0], outs[1], atol=1e-9, rtol=1e-7)
        assert outs[0].requires_grad == outs[1].requires_grad
        if not outs[1].requires_grad:  # everything frozen
            continue
        plain.zero_grad(), layers.zero_grad()
        for out in outs:
            out.pow(2).sum().backward()
        assert_trees_close((grads(layers), [v.grad for v in args[0].values()]),
                           (grads(plain), [v.grad for v in args[1].values()]), atol=1e-9, rtol=1e-7)
