// One GEMM of one expert, for the MoE experts' backward on the CPU (the loop over experts is the binding's
// expert_linear_bwd): ATen's matmul, which is what torch's CPU grouped GEMM runs per group as well.
#include <ATen/ops/mm.h>

#include "lf_common.h"

namespace loongforge {

const char* expert_gemm_backend_cpu() { return "aten"; }

int64_t expert_gemm_workspace_bytes_cpu() { return 0; }

// wgrad = false: out[n, N] = a[n, K] @ b[K, N];  wgrad = true: out[M, N] = a[n, M]^T @ b[n, N].
void expert_gemm_cpu(const at::Tensor& a, const at::Tensor& b, bool wgrad, const at::Tensor& out,
                     const at::Tensor& /*workspace*/) {
    at::Tensor dst = out;
    at::mm_out(dst, wgrad ? a.t() : a, b);
}

}  // namespace loongforge
