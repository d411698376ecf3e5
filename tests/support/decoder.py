"""A small pre-norm transformer decoder block, shared by the scan_layers tests and benchmark."""
import torch
import torch.nn.functional as F


class DecoderBlock(torch.nn.Module):
    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x, attn_mask=None):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Calling(torch.nn.Module):
    """A model whose forward is ``fn(self.ls, x)`` (functional_call keys ``ls.<i>.<name>``)."""

    def __init__(self, ls, fn):
        super().__init__()
        self.ls, self.fn = ls, fn

    def forward(self, x):
        return self.fn(self.ls, x)


def causal_mask(t, device=None):
    return torch.ones(t, t, dtype=torch.bool, device=device).tril()


def make_stack(depth, d=32, heads=4, seed=0):
    torch.manual_seed(seed)
    return torch.nn.ModuleList(DecoderBlock(d, heads) for _ in range(depth))


def run_loop(layers, x, **kwargs):
    for layer in layers:
        x = layer(x, **kwargs)
    return x
