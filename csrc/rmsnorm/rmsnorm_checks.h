// Argument checks of the RMSNorm entry points, shared by the CPU and CUDA builds so both reject the
// same inputs with the same messages. `device` is where every tensor must live.
#pragma once

#include <limits>

#include "lf_common.h"

namespace loongforge {

inline void check_on(const at::Tensor& t, const char* name, c10::DeviceType device) {
    LF_CHECK(t.device().type() == device, "rmsnorm: ", name, " must be on ", device, ", got a tensor on ",
                t.device());
}

// `t` on the very device of the rows `x` (the kernels run under x's device guard and read t's pointer there)
inline void check_with(const at::Tensor& t, const char* name, const at::Tensor& x, c10::DeviceType device) {
    check_on(t, name, device);
    LF_CHECK(t.device() == x.device(), "rmsnorm: ", name, " is on ", t.device(), " but the input on ", x.device(),
             "; move it with .to(", x.device(), ")");
}

inline void check_rmsnorm_rows_and_weight(const at::Tensor& x, const at::Tensor& weight, c10::DeviceType device) {
    check_on(x, "x", device);
    check_on(weight, "weight", device);
    LF_CHECK(x.get_device() == weight.get_device(), "rmsnorm: input on ", x.device(), " but weight on ",
                weight.device());
    LF_CHECK_ROWS(x);
    LF_CHECK_FLOATING(x);
    LF_CHECK_DIM(weight, 1);
    LF_CHECK_CONTIGUOUS(weight);
    LF_CHECK(weight.size(0) == x.size(1), "rmsnorm: weight has ", weight.size(0),
                " elements but the input rows have ", x.size(1), "; the weight must match the hidden size");
    LF_CHECK(x.size(1) > 0 && x.size(1) <= std::numeric_limits<int>::max() / 2,
                "rmsnorm: hidden size must be in [1, 2^30), got ", x.size(1));
}

inline void check_rmsnorm_fwd_args(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                   const at::Tensor& weight, double eps, c10::DeviceType device) {
    check_rmsnorm_rows_and_weight(x, weight, device);
    if (residual.has_value() && residual->defined()) {
        check_with(*residual, "residual", x, device);
        LF_CHECK_ROWS(*residual);
        LF_CHECK(residual->sizes() == x.sizes(), "rmsnorm: residual shape ", residual->sizes(),
                    " differs from input shape ", x.sizes());
        LF_CHECK(residual->scalar_type() == x.scalar_type(), "rmsnorm: residual dtype ",
                    residual->scalar_type(), " differs from input dtype ", x.scalar_type());
    }
    LF_CHECK(eps >= 0, "rmsnorm: eps must be >= 0, got ", eps);
}

inline void check_rmsnorm_bwd_args(const at::Tensor& dy, const at::Tensor& h, const at::Tensor& rstd,
                                   const at::Tensor& weight, const c10::optional<at::Tensor>& dresidual,
                                   c10::DeviceType device) {
    check_rmsnorm_rows_and_weight(h, weight, device);
    check_with(dy, "dy", h, device);
    LF_CHECK_CONTIGUOUS(dy);
    LF_CHECK(dy.sizes() == h.sizes(), "rmsnorm_bwd: grad shape ", dy.sizes(), " differs from input shape ",
                h.sizes());
    LF_CHECK(dy.scalar_type() == h.scalar_type(), "rmsnorm_bwd: grad dtype ", dy.scalar_type(),
                " differs from input dtype ", h.scalar_type());
    check_with(rstd, "rstd", h, device);
    LF_CHECK_DTYPE(rstd, at::kFloat);
    LF_CHECK_SHAPE(rstd, h.size(0));
    if (dresidual.has_value() && dresidual->defined()) {
        check_with(*dresidual, "dresidual", h, device);
        LF_CHECK_CONTIGUOUS(*dresidual);
        LF_CHECK(dresidual->sizes() == h.sizes() && dresidual->scalar_type() == h.scalar_type(),
                    "rmsnorm_bwd: residual grad must match the input, got ", dresidual->sizes(), " ",
                    dresidual->scalar_type());
    }
}

// Run fn.template operator()<W>() with W the weight's element type: the input's type or float.
template <typename T>
void dispatch_weight(const at::Tensor& weight, const char* name, const auto& fn) {
    if (weight.scalar_type() == c10::CppTypeToScalarType<T>::value) {
        fn.template operator()<T>();
    } else if (weight.scalar_type() == at::kFloat) {
        fn.template operator()<float>();
    } else {
        LF_CHECK(false, name, ": weight dtype must equal the input dtype or be float32, got weight ",
                    weight.scalar_type(), " for input ", c10::CppTypeToScalarType<T>::value);
    }
}

}  // namespace loongforge
