// Argument checks of the fused softmax cross-entropy entry points, shared by the CPU and CUDA builds so both
// reject the same inputs with the same messages. `device` is where every tensor must live.
#pragma once

#include <limits>

#include "lf_common.h"

namespace loongforge {

inline void check_xent_on(const at::Tensor& t, const char* name, const at::Tensor& logits, c10::DeviceType device) {
    LF_CHECK(t.device().type() == device && t.get_device() == logits.get_device(), "cross_entropy: ", name,
             " must be on ", logits.device(), " (", device, " build), got a tensor on ", t.device());
}

inline void check_xent_per_row(const at::Tensor& t, const char* name, c10::ScalarType dtype, int64_t rows) {
    LF_CHECK(t.scalar_type() == dtype, "cross_entropy: ", name, " must have dtype ", dtype, ", got ",
             t.scalar_type());
    LF_CHECK(t.dim() == 1 && t.size(0) == rows && (rows <= 1 || t.stride(0) == 1), "cross_entropy: ", name,
             " must be a contiguous [C] tensor with C = ", rows, " (the logits' rows), got shape ", t.sizes(),
             " and strides ", t.strides());
}

// logits [C, V] and grad [C, V] (each fp32/bf16/fp16) are 2-D views with unit stride along V (rows may be
// strided: grad is typically a row slice of a bigger [N, V] buffer); target/valid/scale are contiguous [C].
inline void check_cross_entropy_args(const at::Tensor& logits, const at::Tensor& target, const at::Tensor& valid,
                                     const at::Tensor& scale, const c10::optional<at::Tensor>& grad,
                                     c10::DeviceType device) {
    LF_CHECK(logits.device().type() == device, "cross_entropy: logits must be on ", device,
             ", got a tensor on ", logits.device());
    LF_CHECK_ROWS(logits);
    LF_CHECK_FLOATING(logits);
    const int64_t rows = logits.size(0);
    LF_CHECK(logits.size(1) >= 1 && logits.size(1) <= std::numeric_limits<int32_t>::max(),
             "cross_entropy: the number of classes V must be in [1, 2^31), got ", logits.size(1));
    check_xent_on(target, "target", logits, device);
    check_xent_per_row(target, "target", at::kLong, rows);
    check_xent_on(valid, "valid", logits, device);
    check_xent_per_row(valid, "valid", at::kBool, rows);
    check_xent_on(scale, "scale", logits, device);
    check_xent_per_row(scale, "scale", at::kFloat, rows);
    if (grad.has_value() && grad->defined()) {
        check_xent_on(*grad, "grad", logits, device);
        LF_CHECK_ROWS(*grad);
        LF_CHECK_FLOATING(*grad);
        LF_CHECK(grad->sizes() == logits.sizes(), "cross_entropy: grad must have the logits' shape ",
                 logits.sizes(), ", got ", grad->sizes());
    }
}

// scale_by: x (fp32/bf16/fp16, contiguous) times scale[0] (a float32 device scalar) into out (x's dtype, shape and
// device, contiguous; out may be x).
inline void check_scale_by_args(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& out,
                                c10::DeviceType device) {
    LF_CHECK(x.device().type() == device, "scale_by: x must be on ", device, ", got a tensor on ", x.device());
    LF_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
             "scale_by: x must be float32, bfloat16 or float16, got ", x.scalar_type());
    LF_CHECK(x.is_contiguous(), "scale_by: x must be contiguous, got strides ", x.strides());
    LF_CHECK(scale.device() == x.device() && scale.numel() == 1 && scale.scalar_type() == at::kFloat,
             "scale_by: scale must be a one-element float32 tensor on ", x.device(), ", got ", scale.scalar_type(),
             " of shape ", scale.sizes(), " on ", scale.device());
    LF_CHECK(out.device() == x.device() && out.scalar_type() == x.scalar_type() && out.sizes() == x.sizes() &&
                 out.is_contiguous(),
             "scale_by: out must be a contiguous ", x.scalar_type(), " tensor of x's shape ", x.sizes(), " on ",
             x.device(), ", got ", out.scalar_type(), " of shape ", out.sizes(), " on ", out.device());
}

}  // namespace loongforge
