// rmsnorm: backward entry point (kernels in rmsnorm_kernels.cuh).
#include "rmsnorm_kernels.cuh"

namespace loongforge {

std::vector<at::Tensor> rmsnorm_bwd_cuda(const at::Tensor& dy, const at::Tensor& h,
                                         const at::Tensor& rstd, const at::Tensor& weight,
                                         const c10::optional<at::Tensor>& dresidual, bool stock_rounding) {
    check_rmsnorm_bwd_args(dy, h, rstd, weight, dresidual, c10::DeviceType::CUDA);
    const bool has_dres = dresidual.has_value() && dresidual->defined();
    const c10::cuda::CUDAGuard guard(h.device());
    const int64_t rows = h.size(0);
    const int hidden = static_cast<int>(h.size(1));
    auto dx = at::empty({rows, hidden}, h.options());
    if (rows == 0) return {dx, at::zeros_like(weight)};

    const int elem = h.element_size();
    const bool aligned = lf_aligned16(h.data_ptr()) && (h.stride(0) * elem) % 16 == 0 &&
                         lf_aligned16(dy.data_ptr()) && lf_aligned16(weight.data_ptr()) &&
                         (!has_dres || lf_aligned16(dresidual->data_ptr()));
    const RowPlan plan = plan_rows(hidden, elem, aligned);
    auto stream = c10::cuda::getCurrentCUDAStream();
    const int sms = lf_sm_count();
    auto dw = at::empty_like(weight);
    at::Tensor partial;

    LF_DISPATCH_FLOATING(h.scalar_type(), "rmsnorm_bwd", [&] {
        using T = scalar_t;
        dispatch_weight<T>(weight, "rmsnorm_bwd", [&]<typename W>() {
            const T* dyp = dy.data_ptr<T>();
            const T* hp = h.data_ptr<T>();
            const T* drp = has_dres ? dresidual->data_ptr<T>() : nullptr;
            const W* wp = weight.data_ptr<W>();
            // Persistent grid: as many blocks as fit at once, so dw partials stay few.
            auto blocks_for = [&](auto kernel, int threads, int64_t work_items) {
                const int per_sm = lf_max_blocks_per_sm(kernel, threads);
                return std::max<int64_t>(1, std::min<int64_t>(static_cast<int64_t>(per_sm) * sms,
                                                              work_items));
            };
            if (plan.vpt > 0) {
                const dim3 block(plan.tpr, plan.rows_per_block);
                const int64_t row_groups = (rows + plan.rows_per_block - 1) / plan.rows_per_block;
                constexpr int VF = 16 / sizeof(T);
                dispatch_vpt<VF>(plan.vpt, [&]<int V, int VPT>() {
                    auto run = [&](auto kernel) {
                        const int64_t blocks =
                            blocks_for(kernel, plan.tpr * plan.rows_per_block, row_groups);
                        partial = at::empty({blocks * plan.rows_per_block, hidden},
                                            h.options().dtype(at::kFloat));
                        kernel<<<blocks, block, 0, stream>>>(dyp, hp, h.stride(0),
                                                             rstd.data_ptr<float>(), wp, drp,
                                                             dx.data_ptr<T>(),
                                                             partial.data_ptr<float>(), rows,
                                                             hidden);
                    };
                    // fp32 activations have nothing to round: one instance serves both roundings
                    if constexpr (std::is_same_v<T, float>) {
                        if (has_dres) run(rmsnorm_bwd_kernel<T, W, V, VPT, true, false>);
                        else run(rmsnorm_bwd_kernel<T, W, V, VPT, false, false>);
                    } else if (stock_rounding) {
                        if (has_dres) run(rmsnorm_bwd_kernel<T, W, V, VPT, true, true>);
                        else run(rmsnorm_bwd_kernel<T, W, V, VPT, false, true>);
                    } else {
                        if (has_dres) run(rmsnorm_bwd_kernel<T, W, V, VPT, true, false>);
                        else run(rmsnorm_bwd_kernel<T, W, V, VPT, false, false>);
                    }
                });
            } else {
                auto launch = [&]<int V>() {
                    auto run = [&](auto kernel) {
                        const int64_t blocks = blocks_for(kernel, plan.tpr, rows);
                        partial = at::zeros({blocks, hidden}, h.options().dtype(at::kFloat));
                        kernel<<<blocks, plan.tpr, 0, stream>>>(dyp, hp, h.stride(0),
                                                                rstd.data_ptr<float>(), wp, drp,
                                                                dx.data_ptr<T>(),
                                                                partial.data_ptr<float>(), rows,
                                                                hidden, stock_rounding);
                    };
                    if (has_dres) run(rmsnorm_bwd_streaming_kernel<T, W, V, true>);
                    else run(rmsnorm_bwd_streaming_kernel<T, W, V, false>);
                };
                if (plan.vec == 1) launch.template operator()<1>();
                else launch.template operator()<16 / sizeof(T)>();
            }
            LF_CUDA_CHECK_LAUNCH();
            const dim3 rblock(32, 16);
            rmsnorm_dw_reduce_kernel<W><<<(hidden + 31) / 32, rblock, 0, stream>>>(
                partial.data_ptr<float>(), partial.size(0), hidden, dw.data_ptr<W>());
            LF_CUDA_CHECK_LAUNCH();
        });
    });
    return {dx, dw};
}

}  // namespace loongforge
