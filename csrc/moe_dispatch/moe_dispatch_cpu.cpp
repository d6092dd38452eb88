// MoE dispatch row kernels on the CPU: the same arithmetic as moe_dispatch.cu (fp32 products and sums, pairs of
// a token taken in order j = 0..K-1; the unpermute forward's residual added as its rounding says: "once" starts
// the sum from it and rounds once, "stock" rounds the sum, then adds it and rounds again, as transformers' combine
// followed by its decoder layer's residual add does; with round_products each product is rounded to T before it
// is summed, as torch's multiply of 16-bit weights rounds it). The builder compiles this file with -ffp-contract=off:
// products and sums are rounded one by one, as torch's own CPU kernels round them. Tokens are split over ATen's
// thread pool; each output row is written by one thread, so results do not depend on the thread count.
// Unlike the CUDA build, slot_TK is checked to be a permutation of [0, P) first: one pass over P indices.
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "moe_dispatch_checks.h"

namespace loongforge {
namespace {

constexpr int kLanes = 8;  // independent dot-product accumulators, so the compiler can vectorize the sum

void check_slot_is_permutation(const at::Tensor& slot_TK) {
    const int64_t pairs = slot_TK.numel();
    const int64_t k = slot_TK.size(1);
    const int64_t* slot = slot_TK.data_ptr<int64_t>();
    std::vector<bool> taken(pairs, false);
    for (int64_t i = 0; i < pairs; ++i) {
        const int64_t p = slot[i];
        LF_CHECK(p >= 0 && p < pairs, "moe_dispatch: slot_TK[", i / k, ", ", i % k, "] = ", p,
                    " is outside [0, T*K) = [0, ", pairs, "); use routing_indices() to build slot_TK");
        LF_CHECK(!taken[p], "moe_dispatch: slot_TK holds row ", p, " twice (again at [", i / k, ", ", i % k,
                    "]); it must be a permutation of [0, T*K), as routing_indices() returns it");
        taken[p] = true;
    }
}

// Tokens per parallel_for chunk: about 32768 elements of work (ATen's GRAIN_SIZE), below which another
// thread costs more than it saves.
int64_t token_grain(int64_t hidden, int64_t k) {
    constexpr int64_t kGrainElements = 32768;
    return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, hidden * std::max<int64_t>(k, 1)));
}

}  // namespace

void moe_scatter_rows_cpu(const at::Tensor& src_TH, const at::Tensor& slot_TK, const at::Tensor& weights_TK,
                          const at::Tensor& dst_PH, const at::Tensor& y_PH, const at::Tensor& dweights_TK) {
    check_slot_is_permutation(slot_TK);
    const int64_t tokens = slot_TK.size(0);
    const int64_t k = slot_TK.size(1);
    const int64_t hidden = src_TH.size(1);
    const bool weighted = weights_TK.defined();
    const bool need_dweights = y_PH.defined();
    if (tokens == 0) return;
    LF_DISPATCH_FLOATING(src_TH.scalar_type(), "moe_scatter_rows_cpu", [&] {
        using T = scalar_t;
        const T* src = src_TH.data_ptr<T>();
        const int64_t src_stride = src_TH.stride(0);
        const int64_t* slot = slot_TK.data_ptr<int64_t>();
        const float* weights = weighted ? weights_TK.data_ptr<float>() : nullptr;
        T* dst = dst_PH.data_ptr<T>();
        const T* y = need_dweights ? y_PH.data_ptr<T>() : nullptr;
        const int64_t y_stride = need_dweights ? y_PH.stride(0) : 0;
        float* dweights = need_dweights ? dweights_TK.data_ptr<float>() : nullptr;
        at::parallel_for(0, tokens, token_grain(hidden, k), [&](int64_t begin, int64_t end) {
            for (int64_t t = begin; t < end; ++t) {
                const T* s = src + t * src_stride;
                for (int64_t j = 0; j < k; ++j) {
                    const int64_t pair = t * k + j;
                    T* d = dst + slot[pair] * hidden;
                    if (!weighted) {
                        std::copy(s, s + hidden, d);
                    } else {
                        const float w = weights[pair];
                        for (int64_t c = 0; c < hidden; ++c) d[c] = static_cast<T>(w * static_cast<float>(s[c]));
                    }
                    if (need_dweights) {
                        const T* yr = y + slot[pair] * y_stride;
                        float acc[kLanes] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
                        for (int64_t c = 0; c < hidden; ++c) {
                            acc[c % kLanes] += static_cast<float>(s[c]) * static_cast<float>(yr[c]);
                        }
                        dweights[pair] = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
                    }
                }
            }
        });
    });
}

void moe_gather_rows_cpu(const at::Tensor& src_PH, const at::Tensor& slot_TK, const at::Tensor& weights_TK,
                         const at::Tensor& residual_TH, const at::Tensor& dst_TH, bool stock,
                         bool round_products) {
    check_slot_is_permutation(slot_TK);
    const int64_t tokens = slot_TK.size(0);
    const int64_t k = slot_TK.size(1);
    const int64_t hidden = src_PH.size(1);
    const bool weighted = weights_TK.defined();
    if (tokens == 0) return;
    LF_DISPATCH_FLOATING(src_PH.scalar_type(), "moe_gather_rows_cpu", [&] {
        using T = scalar_t;
        const T* src = src_PH.data_ptr<T>();
        const int64_t src_stride = src_PH.stride(0);
        const int64_t* slot = slot_TK.data_ptr<int64_t>();
        const float* weights = weighted ? weights_TK.data_ptr<float>() : nullptr;
        const T* residual = residual_TH.defined() ? residual_TH.data_ptr<T>() : nullptr;
        const int64_t res_stride = residual_TH.defined() ? residual_TH.stride(0) : 0;
        T* dst = dst_TH.data_ptr<T>();
        at::parallel_for(0, tokens, token_grain(hidden, k), [&](int64_t begin, int64_t end) {
            std::vector<float> acc(hidden);
            for (int64_t t = begin; t < end; ++t) {
                const T* r = residual ? residual + t * res_stride : nullptr;
                if (r && !stock) {  // "once": the sum starts from the residual, as on CUDA: r + w0 y0 + w1 y1 + ...
                    for (int64_t c = 0; c < hidden; ++c) acc[c] = static_cast<float>(r[c]);
                } else {
                    std::fill(acc.begin(), acc.end(), 0.f);
                }
                for (int64_t j = 0; j < k; ++j) {
                    const T* s = src + slot[t * k + j] * src_stride;
                    const float w = weighted ? weights[t * k + j] : 1.f;
                    if (stock && round_products) {  // torch's 16-bit multiply: each product rounded to T
                        for (int64_t c = 0; c < hidden; ++c) {
                            acc[c] += lf_round_to<T>(w * static_cast<float>(s[c]));
                        }
                    } else {
                        for (int64_t c = 0; c < hidden; ++c) acc[c] += w * static_cast<float>(s[c]);
                    }
                }
                T* d = dst + t * hidden;
                if (r && stock) {  // "stock": rnd(r + rnd(w0 y0 + w1 y1 + ...))
                    for (int64_t c = 0; c < hidden; ++c) {
                        d[c] = static_cast<T>(static_cast<float>(r[c]) + lf_round_to<T>(acc[c]));
                    }
                } else {
                    for (int64_t c = 0; c < hidden; ++c) d[c] = static_cast<T>(acc[c]);
                }
            }
        });
    });
}

}  // namespace loongforge
