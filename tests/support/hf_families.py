"""Tiny random configs of the decoder families ``scan_model`` is checked on (offline, float32).

Each builds in well under a second with 2-8 layers of width 32. The patterned ones are given
explicit layer types so that their patterns repeat at least twice (what a scan over blocks
needs) at this depth: Gemma 3 5 sliding + 1 full (14 layers: 2 blocks + 2 layers), GPT-OSS
sliding/full alternating, Qwen3-Next 3 linear + 1 full attention, RecurrentGemma 2 recurrent +
1 attention block.
"""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

V = 64
_COMMON = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
               head_dim=8)


def _gemma3_types(n, full_every):
    return ["full_attention" if (i + 1) % full_every == 0 else "sliding_attention" for i in range(n)]


def build(family, layers=None, full_every=None):
    """A causal LM of ``family`` with ``layers`` decoder layers (its default when None), eager
    attention and no dropout, so that two copies compute the same numbers. Gemma 3 and Qwen3-Next
    have a full attention layer every ``full_every`` layers (by default the real models' 5:1 and
    3:1: every 6th, every 4th)."""
    import transformers as T  # noqa: PLC0415, N812

    n = layers or DEFAULT_DEPTH[family]
    if family == "gpt2":
        model = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=V, n_embd=32, n_layer=n, n_head=4, resid_pdrop=0.0,
                                               embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    elif family == "llama":
        model = T.LlamaForCausalLM(T.LlamaConfig(num_hidden_layers=n, **_COMMON))
    elif family == "mistral":
        model = T.MistralForCausalLM(T.MistralConfig(num_hidden_layers=n, sliding_window=4, **_COMMON))
    elif family == "qwen3":
        model = T.Qwen3ForCausalLM(T.Qwen3Config(num_hidden_layers=n, **_COMMON))
    elif family == "gemma3":
        model = T.Gemma3ForCausalLM(T.Gemma3TextConfig(num_hidden_layers=n, sliding_window=4,
                                                       layer_types=_gemma3_types(n, full_every or 6), **_COMMON))
    elif family == "gpt_oss":
        model = T.GptOssForCausalLM(T.GptOssConfig(
            num_hidden_layers=n, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)], **_COMMON))
    elif family == "qwen3_next":
        model = T.Qwen3NextForCausalLM(T.Qwen3NextConfig(
            num_hidden_layers=n, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            shared_expert_intermediate_size=16, linear_num_value_heads=2, linear_num_key_heads=2,
            linear_key_head_dim=8, linear_value_head_dim=8,
            layer_types=["full_attention" if (i + 1) % (full_every or 4) == 0 else "linear_attention" for i in range(n)],
            **_COMMON))
    elif family == "recurrent_gemma":
        model = T.RecurrentGemmaForCausalLM(T.RecurrentGemmaConfig(
            num_hidden_layers=n, vocab_size=V, hidden_size=32, intermediate_size=64, num_attention_heads=4,
            num_key_value_heads=2, lru_width=32, attention_window_size=4, conv1d_width=2,
            block_types=["recurrent", "recurrent", "attention"]))
    elif family == "mixtral":
        model = T.MixtralForCausalLM(T.MixtralConfig(num_hidden_layers=n, num_local_experts=4, num_experts_per_tok=2,
                                                     **_COMMON))
    else:
        raise KeyError(family)
    model.config._attn_implementation = "eager"
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model


DEFAULT_DEPTH = {"gpt2": 4, "llama": 4, "mistral": 4, "qwen3": 4, "gemma3": 14, "gpt_oss": 4, "qwen3_next": 8,
                 "recurrent_gemma": 6, "mixtral": 4}
# what scan_model makes of each family's default depth (scan_plan)
ALIKE = ("one scan over {n} layers of 2 kinds, each step running its layer's kind (traced, no cache or state "
         "kept per layer; else:)")
PLANS = {
    "gpt2": ["layers 0-3: one scan over 4 layers"],
    "llama": ["layers 0-3: one scan over 4 layers"],
    "mistral": ["layers 0-3: one scan over 4 layers"],
    "qwen3": ["layers 0-3: one scan over 4 layers"],
    "gemma3": ["layers 0-13: " + ALIKE.format(n=14), "layers 0-11: one scan over 2 blocks of 6 layers",
               "layers 12-13: one scan over 2 layers"],
    "gpt_oss": ["layers 0-3: one scan over 2 blocks of 2 layers"],
    "qwen3_next": ["layers 0-7: one scan over 2 blocks of 4 layers"],
    "recurrent_gemma": ["layers 0-5: one scan over 2 blocks of 3 layers"],
    "mixtral": ["layers 0-3: one scan over 4 layers"],
}
FAMILIES = list(PLANS)


def ids(batch=2, length=7, seed=1):
    return torch.randint(0, V, (batch, length), generator=torch.Generator().manual_seed(seed))


def logits_and_loss(model, tokens):
    """The forward a training step compiles: logits and the next-token loss, computed outside the
    model (some families' own loss logs a warning Dynamo cannot trace)."""
    logits = model(input_ids=tokens).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    return logits, loss
