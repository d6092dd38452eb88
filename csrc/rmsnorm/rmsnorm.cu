// rmsnorm: forward entry point (kernels in rmsnorm_kernels.cuh).
#include "rmsnorm_kernels.cuh"

namespace loongforge {

std::vector<at::Tensor> rmsnorm_fwd_cuda(const at::Tensor& x,
                                         const c10::optional<at::Tensor>& residual,
                                         const at::Tensor& weight, double eps, bool stock_rounding) {
    check_rmsnorm_fwd_args(x, residual, weight, eps, c10::DeviceType::CUDA);
    const bool has_res = residual.has_value() && residual->defined();
    const c10::cuda::CUDAGuard guard(x.device());
    const int64_t rows = x.size(0);
    const int hidden = static_cast<int>(x.size(1));
    auto y = at::empty({rows, hidden}, x.options());
    auto h_out = has_res ? at::empty({rows, hidden}, x.options()) : at::Tensor();
    auto rstd = at::empty({rows}, x.options().dtype(at::kFloat));
    if (rows == 0) return {y, h_out, rstd};

    const int elem = x.element_size();
    bool aligned = lf_aligned16(x.data_ptr()) && (x.stride(0) * elem) % 16 == 0 &&
                   lf_aligned16(weight.data_ptr());
    if (has_res) {
        aligned = aligned && lf_aligned16(residual->data_ptr()) &&
                  (residual->stride(0) * elem) % 16 == 0;
    }
    const RowPlan plan = plan_rows(hidden, elem, aligned);
    auto stream = c10::cuda::getCurrentCUDAStream();
    const int64_t max_grid = static_cast<int64_t>(lf_sm_count()) * 64;

    LF_DISPATCH_FLOATING(x.scalar_type(), "rmsnorm_fwd", [&] {
        using T = scalar_t;
        dispatch_weight<T>(weight, "rmsnorm_fwd", [&]<typename W>() {
            const T* xp = x.data_ptr<T>();
            const T* rp = has_res ? residual->data_ptr<T>() : nullptr;
            const int64_t rs = has_res ? residual->stride(0) : 0;
            const W* wp = weight.data_ptr<W>();
            T* hp = has_res ? h_out.data_ptr<T>() : nullptr;
            const float feps = static_cast<float>(eps);
            if (plan.vpt > 0) {
                const dim3 block(plan.tpr, plan.rows_per_block);
                const int64_t blocks = std::min(
                    max_grid, (rows + plan.rows_per_block - 1) / plan.rows_per_block);
                constexpr int VF = 16 / sizeof(T);
                dispatch_vpt<VF>(plan.vpt, [&]<int V, int VPT>() {
                    if (has_res) {
                        rmsnorm_fwd_kernel<T, W, V, VPT, true><<<blocks, block, 0, stream>>>(
                            xp, x.stride(0), rp, rs, wp, y.data_ptr<T>(), hp,
                            rstd.data_ptr<float>(), rows, hidden, feps, stock_rounding);
                    } else {
                        rmsnorm_fwd_kernel<T, W, V, VPT, false><<<blocks, block, 0, stream>>>(
                            xp, x.stride(0), rp, rs, wp, y.data_ptr<T>(), hp,
                            rstd.data_ptr<float>(), rows, hidden, feps, stock_rounding);
                    }
                });
            } else {
                const int64_t blocks = std::min(max_grid, rows);
                auto launch = [&]<int V>() {
                    if (has_res) {
                        rmsnorm_fwd_streaming_kernel<T, W, V, true><<<blocks, plan.tpr, 0, stream>>>(
                            xp, x.stride(0), rp, rs, wp, y.data_ptr<T>(), hp,
                            rstd.data_ptr<float>(), rows, hidden, feps, stock_rounding);
                    } else {
                        rmsnorm_fwd_streaming_kernel<T, W, V, false><<<blocks, plan.tpr, 0, stream>>>(
                            xp, x.stride(0), rp, rs, wp, y.data_ptr<T>(), hp,
                            rstd.data_ptr<float>(), rows, hidden, feps, stock_rounding);
                    }
                };
                if (plan.vec == 1) launch.template operator()<1>();
                else launch.template operator()<16 / sizeof(T)>();
            }
            LF_CUDA_CHECK_LAUNCH();
        });
    });
    return {y, h_out, rstd};
}

}  // namespace loongforge
