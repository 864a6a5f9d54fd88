"""Small Flax NNX models with the rule tables that port HuggingFace checkpoints.

Each module holds a config (``Config.from_hf`` reads a ``transformers`` config by
attribute, without importing transformers), the NNX model, and ``RULES``: the
:class:`nnx_save.porting.Rules` mapping the keys ``save_pretrained`` writes to the
model's state paths. ``RULES.inverse()`` writes them back.

- :mod:`.gpt2`: GPT-2 (``GPT2LMHeadModel``): fused qkv split, Conv1D, tied head;
  ``ScannedGPT2`` / ``SCANNED_RULES``: stacked layers, separate q / k / v.
- :mod:`.llama`: Llama-style decoder (``LlamaForCausalLM``): RMSNorm, rotary
  embeddings, grouped-query attention, SwiGLU, untied head; ``ScannedLlama`` /
  ``SCANNED_RULES``: stacked layers.
- :mod:`.bert`: BERT encoder (``BertForSequenceClassification``): post-norm layers,
  token-type embeddings, tanh pooler.
- :mod:`.vit`: ViT encoder (``ViTForImageClassification``): conv patch embedding,
  class token, classification head.
"""
