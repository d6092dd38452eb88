"""Mixtral: softmax top-k router, always renormalised; no shared expert."""

from ds_loongforge.integrations.presets import FamilyPreset, MoESpec

PRESET = FamilyPreset(
    name="mixtral",
    modeling_module="transformers.models.mixtral.modeling_mixtral",
    rmsnorm=("MixtralRMSNorm",),
    attention=("MixtralAttention",),
    moe=MoESpec(block="MixtralSparseMoeBlock", router="softmax_topk", renormalize_attr=None),
    rope="apply_rotary_pos_emb",
    decoder_layer="MixtralDecoderLayer",
)
