"""Llama (dense): RMSNorm and SwiGLU MLP (with or without mlp_bias)."""

from ds_loongforge.integrations.presets import FamilyPreset

PRESET = FamilyPreset(
    name="llama",
    modeling_module="transformers.models.llama.modeling_llama",
    rmsnorm=("LlamaRMSNorm",),
    attention=("LlamaAttention",),
    mlp=("LlamaMLP",),
    rope="apply_rotary_pos_emb",
    decoder_layer="LlamaDecoderLayer",
)
