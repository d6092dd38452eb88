// swiglu: forward entry point (kernels in swiglu_kernels.cuh).
#include "swiglu_kernels.cuh"

namespace loongforge {

at::Tensor swiglu_fwd_cuda(const at::Tensor& gate_up, double p, int64_t seed, int64_t offset,
                           bool stock_rounding) {
    check_swiglu_fwd_args(gate_up, p, c10::DeviceType::CUDA);
    const DropoutArgs d = make_dropout_args(p, seed, offset);
    const c10::cuda::CUDAGuard guard(gate_up.device());
    const int64_t rows = gate_up.size(0);
    const int64_t inter = gate_up.size(1) / 2;
    auto out = at::empty({rows, inter}, gate_up.options());
    if (rows == 0 || inter == 0) return out;
    const int64_t elem = gate_up.element_size();
    const int64_t vf = 16 / elem;
    const bool vec_ok = inter % vf == 0 && lf_aligned16(gate_up.data_ptr()) &&
                        (gate_up.stride(0) * elem) % 16 == 0;
    auto stream = c10::cuda::getCurrentCUDAStream();
    LF_DISPATCH_FLOATING(gate_up.scalar_type(), "swiglu_fwd", [&] {
        using T = scalar_t;
        auto launch = [&]<int V>() {
            const Launch l = launch_for(rows, inter / V);
            if (p > 0.0) {
                swiglu_fwd_kernel<T, V, true><<<l.grid, l.block, 0, stream>>>(
                    gate_up.data_ptr<T>(), gate_up.stride(0), out.data_ptr<T>(), rows, inter, d,
                    stock_rounding);
            } else {
                swiglu_fwd_kernel<T, V, false><<<l.grid, l.block, 0, stream>>>(
                    gate_up.data_ptr<T>(), gate_up.stride(0), out.data_ptr<T>(), rows, inter, d,
                    stock_rounding);
            }
        };
        if (vec_ok) launch.template operator()<16 / sizeof(T)>();
        else launch.template operator()<1>();
        LF_CUDA_CHECK_LAUNCH();
    });
    return out;
}

}  // namespace loongforge
