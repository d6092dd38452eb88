"""DeepSeek-V3: the router (sigmoid scores, e_score_correction_bias, group-limited top-k,
routed_scaling_factor) is not a softmax top-k, so the model's router is kept and feeds the expert path;
the shared experts (a dense SwiGLU MLP) are added unscaled. The first_k_dense_replace layers are MLPs.
Its rotary embedding is not replaced: it rotates only the qk_rope_head_dim slice of each head, in interleaved
pairs by default (apply_rotary_pos_emb_interleave), which Liger's RoPE does not compute."""

from ds_loongforge.integrations.presets import FamilyPreset, MoESpec

PRESET = FamilyPreset(
    name="deepseek_v3",
    modeling_module="transformers.models.deepseek_v3.modeling_deepseek_v3",
    rmsnorm=("DeepseekV3RMSNorm",),
    mlp=("DeepseekV3MLP",),
    moe=MoESpec(block="DeepseekV3MoE", router="transformers", renormalize_attr=None,
                shared_expert="shared_experts"),
    rope=None,
    rope_why_not=("partial, interleaved rotary embedding (only the qk_rope_head_dim slice of each head, "
                  "apply_rotary_pos_emb_interleave when rope_interleave), not the standard rotate_half form "
                  "Liger's fused RoPE computes"),
    decoder_layer="DeepseekV3DecoderLayer",
)
