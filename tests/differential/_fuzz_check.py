"""What a differential case compares with the loop, and how closely (shared by every mode's runner)."""
import pytest
import torch
from conftest import assert_trees_close

from torch_scan_hop import scan


def tolerances(p, mode):
    if p.dtype == torch.float64 and "float32" in p.source and mode != "eager":
        # a float32 round trip in a float64 body: a compiler's other (exact in float64) order of
        # the ops before it can round one ulp of float32 the other way
        return dict(rtol=1e-5, atol=1e-7)
    if p.dtype == torch.float64:
        return dict(rtol=1e-6, atol=1e-8) if mode == "xla" else dict(rtol=1e-7, atol=1e-9)
    return dict(rtol=1e-4, atol=1e-5)


class Mismatch(AssertionError):
    pass


def check(p, mode, what, got, want):
    try:
        assert_trees_close(got, want, **tolerances(p, mode))
    except AssertionError as e:
        raise Mismatch(f"{what} differ from the loop's: {e}") from None


def traceable_kwargs(p, inst, dynamo):
    """``p.kwargs()``; a remat function, which a Dynamo graph cannot hold, must fail clearly
    under ``dynamo(f)`` and is then replaced by a named policy."""
    kw = p.kwargs()
    if callable(kw["remat"]):
        with pytest.raises(Exception, match="remat=<callable> is not supported under torch.compile"):
            dynamo(lambda init, xs: scan(inst.body, init, xs, **kw))(inst.init, inst.xs)
        kw["remat"] = "save_all"
    return kw
