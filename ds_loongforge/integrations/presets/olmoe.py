"""OLMoE: softmax top-k router (renormalised if norm_topk_prob); q/k norms are the same RMSNorm class."""

from ds_loongforge.integrations.presets import FamilyPreset, MoESpec

PRESET = FamilyPreset(
    name="olmoe",
    modeling_module="transformers.models.olmoe.modeling_olmoe",
    rmsnorm=("OlmoeRMSNorm",),
    attention=("OlmoeAttention",),
    mlp=("OlmoeMLP",),
    moe=MoESpec(block="OlmoeSparseMoeBlock", router="softmax_topk", weights_in_input_dtype=True),
    rope="apply_rotary_pos_emb",
    decoder_layer="OlmoeDecoderLayer",
)
