"""A question answered in plain Python while Dynamo traces (``layers.trace_time``): the answer is a
constant of the trace (no op of the question in the graph), computed on the real objects and the
tensors' fake example values; where it cannot be (the function raises, a value has no stand-in),
the caller's default."""
import torch

from torch_scan_hop.layers import trace_time

SEEN = []


def _shape_and_scale(t, module, extra):
    """Reads a tensor's metadata, a module's attribute and plain containers."""
    SEEN.append((type(t).__name__, type(module).__name__))
    return (tuple(t.shape), module.scale, extra["k"], extra["pair"][1])


def _raises(t):
    raise ValueError("no answer")


def _answers_a_tensor(t):
    return t


class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = 3
        self.lin = torch.nn.Linear(2, 2)


def _compiled(fn, *args):
    graphs = []

    def backend(gm, _):
        graphs.append(gm)
        return gm.forward
    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return out, [n.target for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]


def test_the_answer_is_a_constant_computed_on_fakes():
    module = Scaled()

    def fn(x):
        shape, scale, k, second = trace_time.ask(_shape_and_scale, None, x * 2, module, {"k": 5, "pair": (1, 7)})
        return x + shape[0] * scale + k + second

    SEEN.clear()
    before = trace_time.counts().get("answered", 0)
    out, ops = _compiled(fn, torch.zeros(4))
    torch.testing.assert_close(out, torch.full((4,), 4 * 3 + 5 + 7.0))
    assert trace_time.counts()["answered"] > before
    assert SEEN and all(seen == ("FakeTensor", "Scaled") for seen in SEEN)  # run while tracing, on a fake
    assert all(t is not trace_time._at_trace_time for t in ops)  # the question is not in the graph


def test_a_function_that_raises_gives_the_default():
    before = trace_time.counts().get("raised ValueError", 0)
    out, _ = _compiled(lambda x: x + trace_time.ask(_raises, 2, x), torch.zeros(3))
    torch.testing.assert_close(out, torch.full((3,), 2.0))
    assert trace_time.counts()["raised ValueError"] > before


def test_an_answer_that_is_no_constant_is_refused():
    import pytest

    with pytest.raises(Exception, match="answered"):
        _compiled(lambda x: x + trace_time.ask(_answers_a_tensor, 0, x), torch.zeros(3))


def test_outside_dynamo_the_default():
    assert trace_time.ask(_shape_and_scale, "default", torch.zeros(2), Scaled(), {"k": 1, "pair": (0, 0)}) == "default"


def test_a_module_the_frame_changed_gives_the_default():
    """The real module lags the trace once the compiled frame set one of its attributes: no
    answer from it (the traced code's general path reads what the frame set)."""
    module = Scaled()

    def fn(x):
        module.lin.extra = 1  # a submodule changed in the frame
        answer = trace_time.ask(_shape_and_scale, None, x, module, {"k": 5, "pair": (1, 7)})
        return x + (0 if answer is None else 1)

    out, _ = _compiled(fn, torch.zeros(2))
    torch.testing.assert_close(out, torch.zeros(2))
