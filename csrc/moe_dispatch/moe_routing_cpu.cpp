// MoE routing indices on the CPU: the stable counting sort of moe_routing.cu (same outputs), in two passes over
// the P pairs. Unlike the CUDA build, an id outside [0, E) is an error here (it can be checked without a sync).
#include <algorithm>
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

}  // namespace loongforge
