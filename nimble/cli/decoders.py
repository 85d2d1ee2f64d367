"""The transformers causal language models that decoding is measured and tested with (random
weights, no downloads; needs ``transformers``).

``gpt2`` is ``GPT2Config()``'s 124M-parameter GPT-2; ``gpt2_tiny`` a 4-layer one for quick tests;
``llama_small`` the Llama-architecture model of ``tools/record_fixture.py``'s fixtures;
``llama_1b`` a Llama of about 0.85B parameters (hidden 2048, 16 layers, grouped-query attention
with 8 key-value heads of 64); ``llama3_1b`` Llama-3.2-1B's shape (the same attention, an MLP of
8192, a vocabulary of 128256 and the embedding tied to the language-model head), the model the
issue "Decoding near the memory-bandwidth limit" sets its targets on; ``llama3_8b``
Llama-3-8B's shape (hidden 4096, 32 layers, an MLP of 14336; 16 GB in 16-bit), where a decode
step is long enough for splitting it over GPUs to pay.
"""
from __future__ import annotations

#: The small Llama's size, with grouped-query attention (each of the two key-value heads serves
#: four query heads) as in the Llama family.
LLAMA_SMALL = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4,
               "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 32000}
#: A Llama of about 0.85B parameters.
LLAMA_1B = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 16,
            "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000}
#: Llama-3.2-1B's shape: its published config's sizes, with the token embedding and the
#: language-model head one tensor (so a decode step reads that table once, in the head).
LLAMA3_1B = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
             "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
             "tie_word_embeddings": True}
#: Llama-3-8B's shape: its published config's sizes (the embedding and head untied).
LLAMA3_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256}
#: A GPT-2 small enough for quick decoding tests.
GPT2_TINY = {"n_layer": 4, "n_embd": 256, "n_head": 4}
#: The names :func:`causal_lm` builds.
CAUSAL_LMS = ("gpt2", "gpt2_tiny", "llama_small", "llama_1b", "llama3_1b", "llama3_8b")
#: The Llama-architecture configs by name.
LLAMAS = {"llama_small": LLAMA_SMALL, "llama_1b": LLAMA_1B, "llama3_1b": LLAMA3_1B,
          "llama3_8b": LLAMA3_8B}
#: Models built on the GPU in their dtype: in float32 on the CPU they take minutes and 32 GB.
BUILT_ON_GPU = ("llama3_8b",)


def config_of(name: str):
    """The transformers config of ``name``."""
    import transformers

    if name in ("gpt2", "gpt2_tiny"):
        return transformers.GPT2Config(**(GPT2_TINY if name == "gpt2_tiny" else {}))
    if name in LLAMAS:
        return transformers.LlamaConfig(**LLAMAS[name])
    raise ValueError(f"no causal LM {name!r}; there are {', '.join(CAUSAL_LMS)}")


def causal_lm(name: str, dtype: str = "float16"):
    """``name``'s decoder with its language-model head on the GPU in eval mode, in ``dtype``,
    random weights from seed 0 (drawn on the CPU in float32, or for :data:`BUILT_ON_GPU` on the
    GPU in ``dtype``: other numbers from the same seed)."""
    import torch
    import transformers

    config = config_of(name)
    torch.manual_seed(0)
    cls = transformers.GPT2LMHeadModel if name.startswith("gpt2") else \
        transformers.LlamaForCausalLM
    if name not in BUILT_ON_GPU:
        return cls(config).cuda().eval().to(getattr(torch, dtype))
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        with torch.device("cuda"):
            return cls(config).eval()
    finally:
        torch.set_default_dtype(default)
