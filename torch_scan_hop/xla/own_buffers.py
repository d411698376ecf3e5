"""Device data that only our Whiles hold: the body's constants and the ys buffers' fill values.

torch_xla keeps a cache of device buffers for scalars: a Python number in an op, ``torch.full``'s
value and a 0-d tensor moved to the device all get the cached buffer of that number, shared with
every other op using it while it stays cached. A step's program takes each distinct buffer as
ONE parameter, so whether a While's operand and an eager op outside it (a gradient's scale, a
norm's epsilon) were one parameter or two changed with what the cache had evicted since the last
step, and every change was a new program for XLA to compile: Gemma 3 at 12 layers compiled its
second and third training steps anew, 25 s each. A buffer of our own (a 1-element or flat
tensor: transfers of those bypass the cache) is always its own parameter, so the program stays
the same from step to step.
"""
import torch


class OwnBuffer:
    """A tensor's value, in a flat buffer no other op shares; ``shape`` and ``dtype`` as the
    tensor's (a While's signature reads them)."""

    def __init__(self, t):
        self.flat = t.detach().cpu().reshape(-1).to(t.device)
        self.shape, self.dtype = tuple(t.shape), t.dtype

    def value(self):
        """The value with its shape: a new view per call, so the step's program reads the flat
        buffer through a reshape every time (a stored view would be materialized by a sync into
        a buffer of its own, and the next step's program would differ once)."""
        return self.flat.reshape(self.shape)


_fill_values = {}  # (value, dtype, device) -> a 1-element tensor of our own


def filled(value, dtype, device, shape):
    """A new tensor of ``shape`` holding ``value`` (as ``torch.full``), from a buffer only
    our Whiles use; 0 and 1, torch_xla's special scalars, are constants of the program."""
    if value in (0, 1):
        return torch.full(shape, value, dtype=dtype, device=device)
    key = (value, dtype, str(device))
    one = _fill_values.get(key)
    if one is None:
        one = _fill_values[key] = torch.tensor([value], dtype=dtype, device=device)
    return one.reshape((1,) * len(shape)).expand(shape).contiguous()
