// One expert's backward products through ATen (at::mm_out): the whole CPU build (moe_expert_gemm_cpu.cpp) and the
// CUDA build's fallback where cuBLASLt has no algorithm or was not built in (moe_expert_gemm.cpp).
//   dx_PI[start:start+n] = dy_PO[start:start+n] @ w_EOI[e]        dw_EOI[e] = dy_PO[start:start+n]^T @ x_PI[start:start+n]
#pragma once

#include <ATen/ops/mm.h>

namespace loongforge {

inline void expert_backward_aten(const at::Tensor& dy_PO, const at::Tensor& x_PI, const at::Tensor& w_EOI, int64_t e,
                                 int64_t start, int64_t n, const at::Tensor& dx_PI, const at::Tensor& dw_EOI,
                                 bool do_dx, bool do_dw) {
    const at::Tensor dy = dy_PO.narrow(0, start, n);
    if (do_dx) {
        at::Tensor dst = dx_PI.narrow(0, start, n);
        at::mm_out(dst, dy, w_EOI[e]);
    }
    if (do_dw) {
        at::Tensor dst = dw_EOI[e];
        at::mm_out(dst, dy.t(), x_PI.narrow(0, start, n));
    }
}

}  // namespace loongforge
