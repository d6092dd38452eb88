// MoE router top-k on the CPU: the semantics of moe_router.cu (softmax in fp32, the k largest probabilities with
// the lowest expert first among equal values and NaN above every number, optional renormalisation; the backward
// through all three), one token per iteration in a fixed order.
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

#include "moe_dispatch_checks.h"

namespace loongforge {
namespace {

float topk_key(float p) { return std::isnan(p) ? std::numeric_limits<float>::infinity() : p; }

}  // namespace

void moe_router_topk_fwd_cpu(const at::Tensor& logits_TE, int64_t k, bool renormalize, const at::Tensor& probs_TE,
                             const at::Tensor& weights_TK, const at::Tensor& ids_TK) {
    const int64_t tokens = logits_TE.size(0);
    const int64_t experts = logits_TE.size(1);
    float* probs = probs_TE.data_ptr<float>();
    float* weights = weights_TK.data_ptr<float>();
    int64_t* ids = ids_TK.data_ptr<int64_t>();
    LF_DISPATCH_FLOATING(logits_TE.scalar_type(), "moe_router_topk", [&] {
        const scalar_t* logits = logits_TE.data_ptr<scalar_t>();
        at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
            std::vector<char> chosen(experts);
            for (int64_t t = begin; t < end; ++t) {
                const scalar_t* row = logits + t * experts;
                float* p = probs + t * experts;
                float mx = -std::numeric_limits<float>::infinity();
                for (int64_t e = 0; e < experts; ++e) mx = std::fmax(mx, static_cast<float>(row[e]));
                double sum = 0.0;
                for (int64_t e = 0; e < experts; ++e) {
                    p[e] = std::exp(static_cast<float>(row[e]) - mx);
                    sum += p[e];
                }
                const float total = static_cast<float>(sum);
                for (int64_t e = 0; e < experts; ++e) p[e] /= total;
                std::fill(chosen.begin(), chosen.end(), 0);
                double chosen_sum = 0.0;
                for (int64_t j = 0; j < k; ++j) {
                    int64_t best_e = -1;
                    for (int64_t e = 0; e < experts; ++e) {
                        if (!chosen[e] && (best_e < 0 || topk_key(p[e]) > topk_key(p[best_e]))) best_e = e;
                    }
                    chosen[best_e] = 1;
                    ids[t * k + j] = best_e;
                    weights[t * k + j] = p[best_e];
                    chosen_sum += p[best_e];
                }
                if (renormalize) {
                    const float chosen_total = static_cast<float>(chosen_sum);
                    for (int64_t j = 0; j < k; ++j) weights[t * k + j] /= chosen_total;
                }
            }
        });
    });
}

void moe_router_topk_bwd_cpu(const at::Tensor& dweights_TK, const at::Tensor& dprobs_TE, const at::Tensor& probs_TE,
                             const at::Tensor& ids_TK, bool renormalize, const at::Tensor& dlogits_TE) {
    const int64_t tokens = probs_TE.size(0);
    const int64_t experts = probs_TE.size(1);
    const int64_t k = ids_TK.size(1);
    const float* dweights = dweights_TK.data_ptr<float>();
    const float* dprobs = dprobs_TE.defined() ? dprobs_TE.data_ptr<float>() : nullptr;
    const float* probs = probs_TE.data_ptr<float>();
    const int64_t* ids = ids_TK.data_ptr<int64_t>();
    LF_DISPATCH_FLOATING(dlogits_TE.scalar_type(), "moe_router_topk_bwd", [&] {
        scalar_t* dlogits = dlogits_TE.data_ptr<scalar_t>();
        at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
            std::vector<float> dp(experts);
            for (int64_t t = begin; t < end; ++t) {
                const float* p = probs + t * experts;
                const float* dw = dweights + t * k;
                const int64_t* id = ids + t * k;
                for (int64_t e = 0; e < experts; ++e) dp[e] = dprobs != nullptr ? dprobs[t * experts + e] : 0.f;
                double s = 0.0, dot = 0.0;
                if (renormalize) {
                    for (int64_t j = 0; j < k; ++j) s += p[id[j]];
                    for (int64_t j = 0; j < k; ++j) dot += dw[j] * (p[id[j]] / s);
                }
                for (int64_t j = 0; j < k; ++j) {
                    dp[id[j]] += renormalize ? static_cast<float>((dw[j] - dot) / s) : dw[j];
                }
                double pdp_sum = 0.0;
                for (int64_t e = 0; e < experts; ++e) pdp_sum += static_cast<double>(p[e]) * dp[e];
                const float pdp = static_cast<float>(pdp_sum);
                for (int64_t e = 0; e < experts; ++e) {
                    dlogits[t * experts + e] = static_cast<scalar_t>(p[e] * (dp[e] - pdp));
                }
            }
        });
    });
}

}  // namespace loongforge
