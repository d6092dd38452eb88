// MoE routing indices on the CPU: the stable counting sort of moe_routing.cu (same outputs), in two passes over
// the P pairs. Unlike the CUDA build, an id outside [0, E) is an error here (it can be checked without a sync).
// And the top-k choice counts of moe_routing.cu.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "moe_dispatch_checks.h"

namespace loongforge {

void moe_routing_indices_cpu(const at::Tensor& ids_TK, int64_t num_experts, const at::Tensor& order_P,
                             const at::Tensor& slot_TK, const at::Tensor& counts_E, const at::Tensor& offsets_E) {
    const int64_t pairs = ids_TK.numel();
    const int64_t k = ids_TK.size(1);
    const int64_t* ids = ids_TK.data_ptr<int64_t>();
    int64_t* counts = counts_E.data_ptr<int64_t>();
    std::fill(counts, counts + num_experts, int64_t{0});
    for (int64_t i = 0; i < pairs; ++i) {
        const int64_t e = ids[i];
        LF_CHECK(e >= 0 && e < num_experts, "moe_routing_indices: ids_TK[", i / k, ", ", i % k, "] = ", e,
                 " is outside [0, num_experts) = [0, ", num_experts, ")");
        ++counts[e];
    }
    std::vector<int64_t> next(num_experts);
    int* offsets = offsets_E.data_ptr<int>();
    int64_t start = 0;
    for (int64_t e = 0; e < num_experts; ++e) {
        next[e] = start;
        start += counts[e];
        offsets[e] = static_cast<int>(start);
    }
    int64_t* slot = slot_TK.data_ptr<int64_t>();
    int64_t* order = order_P.data_ptr<int64_t>();
    for (int64_t i = 0; i < pairs; ++i) {
        const int64_t pos = next[ids[i]]++;
        slot[i] = pos;
        order[pos] = i;
    }
}

// Top-k choice counts (moe_routing.cu's topk_counts_kernel): the same rank keys, so the same choices and counts.
void moe_topk_counts_cpu(const at::Tensor& values_RE, int64_t k, const at::Tensor& weights_R,
                         const at::Tensor& counts_E) {
    const int64_t rows = values_RE.size(0);
    const int64_t columns = values_RE.size(1);
    const int64_t* weights = weights_R.defined() ? weights_R.data_ptr<int64_t>() : nullptr;
    const int64_t period = weights_R.defined() ? weights_R.numel() : 1;
    // unsigned sums: int64 weights of any sign add as two's complement, without signed overflow
    std::vector<uint64_t> counts(static_cast<size_t>(columns), 0u);
    LF_DISPATCH_FLOATING(values_RE.scalar_type(), "moe_topk_counts", [&] {
        using T = scalar_t;
        const T* values = values_RE.data_ptr<T>();
        for (int64_t r = 0; r < rows; ++r) {
            const T* row = values + r * columns;
            const uint64_t w = weights != nullptr ? static_cast<uint64_t>(weights[r % period]) : 1u;
            uint64_t previous = ~uint64_t{0};
            for (int64_t j = 0; j < k; ++j) {
                uint64_t best = 0;
                for (int64_t e = 0; e < columns; ++e) {
                    const uint64_t key = topk_rank_key(static_cast<float>(row[e]), e);
                    if (key < previous && key > best) best = key;
                }
                counts[0xfffffffeu - static_cast<uint32_t>(best)] += w;
                previous = best;
            }
        }
    });
    int64_t* out = counts_E.data_ptr<int64_t>();
    for (int64_t e = 0; e < columns; ++e) out[e] = static_cast<int64_t>(counts[e]);
}

}  // namespace loongforge
