// Argument checks of the SwiGLU(+dropout) entry points, shared by the CPU and CUDA builds so both reject
// the same inputs with the same messages. `device` is where every tensor must live.
#pragma once

#include "lf_common.h"

namespace loongforge {

inline void check_swiglu_fwd_args(const at::Tensor& gate_up, double p, c10::DeviceType device) {
    LF_CHECK(gate_up.device().type() == device, "swiglu: gate_up must be on ", device, ", got a tensor on ",
                gate_up.device());
    LF_CHECK_ROWS(gate_up);
    LF_CHECK_FLOATING(gate_up);
    LF_CHECK(gate_up.size(1) % 2 == 0, "swiglu: the last dimension holds [gate | up] and must be even, got ",
                gate_up.size(1));
    LF_CHECK(p >= 0.0 && p < 1.0, "swiglu_dropout: p must be in [0, 1), got ", p);
}

inline void check_swiglu_bwd_args(const at::Tensor& dout, const at::Tensor& gate_up, double p,
                                  c10::DeviceType device) {
    check_swiglu_fwd_args(gate_up, p, device);
    LF_CHECK(dout.device() == gate_up.device(), "swiglu_bwd: grad on ", dout.device(), " but gate_up on ",
                gate_up.device());
    LF_CHECK_CONTIGUOUS(dout);
    LF_CHECK_SHAPE(dout, gate_up.size(0), gate_up.size(1) / 2);
    LF_CHECK(dout.scalar_type() == gate_up.scalar_type(), "swiglu_bwd: grad dtype ", dout.scalar_type(),
                " differs from input dtype ", gate_up.scalar_type());
}

}  // namespace loongforge
