"""DeepSeek-V3: the router (sigmoid scores, e_score_correction_bias, group-limited top-k,
routed_scaling_factor) is not a softmax top-k, so the model's router is kept and feeds the expert path;
the shared experts (a dense SwiGLU MLP) are added unscaled. The first_k_dense_replace layers are MLPs."""

from ds_loongforge.integrations.presets import FamilyPreset, MoESpec

PRESET = FamilyPreset(
    name="deepseek_v3",
    modeling_module="transformers.models.deepseek_v3.modeling_deepseek_v3",
    rmsnorm=("DeepseekV3RMSNorm",),
    mlp=("DeepseekV3MLP",),
    moe=MoESpec(block="DeepseekV3MoE", router="transformers", renormalize_attr=None,
                shared_expert="shared_experts"),
)
