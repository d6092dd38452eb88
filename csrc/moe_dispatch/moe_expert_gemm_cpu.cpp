// The MoE experts' backward on the CPU, one GEMM per expert and product (the binding's expert_linear_bwd checks
// and allocates): ATen's matmul (moe_expert_gemm_aten.h), which is what torch's CPU grouped GEMM runs per group as well.
#include "lf_common.h"
#include "moe_expert_gemm_aten.h"

namespace loongforge {

const char* expert_gemm_backend_cpu() { return "aten"; }

// As expert_linear_bwd_cuda (moe_expert_gemm.cpp): dx_PI[rows of e] = dy_PO[rows of e] @ w_EOI[e] and
// dw_EOI[e] = dy_PO[rows of e]^T @ x_PI[rows of e], zeros for an expert without rows; undefined outputs skipped.
// row_bucket (the CUDA build's algorithm grouping) has nothing to choose here.
void expert_linear_bwd_cpu(const at::Tensor& dy_PO, const at::Tensor& x_PI, const at::Tensor& w_EOI,
                           const std::vector<int64_t>& counts, int64_t /*row_bucket*/, const at::Tensor& dx_PI,
                           const at::Tensor& dw_EOI) {
    int64_t start = 0;
    for (size_t e = 0; e < counts.size(); ++e) {
        const int64_t n = counts[e];
        if (n == 0) {
            if (dw_EOI.defined()) dw_EOI[e].zero_();
            continue;
        }
        expert_backward_aten(dy_PO, x_PI, w_EOI, e, start, n, dx_PI, dw_EOI, dx_PI.defined(), dw_EOI.defined());
        start += n;
    }
}

}  // namespace loongforge
