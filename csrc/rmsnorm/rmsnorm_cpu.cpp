// Fused RMSNorm on the CPU: the same arithmetic as rmsnorm.cu (fp32 accumulation; one rounding per output, or
// with stock_rounding the roundings of transformers' eager RMSNorm and its autograd, see rmsnorm_kernels.cuh).
// Rows are split over ATen's thread pool; sums use 8 independent accumulators so the compiler can vectorize them.
// dw is summed per fixed row chunk and the chunks are added in order, so the result does not depend on the number
// of threads.
#include <ATen/Parallel.h>

#include <cmath>
#include <type_traits>
#include <vector>

#include "rmsnorm_checks.h"

namespace loongforge {
namespace {

constexpr int kLanes = 8;
constexpr int64_t kMaxDwChunks = 64;

inline float lane_sum(const float (&acc)[kLanes]) {
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

template <typename T, typename W>
void fwd_rows(const T* x, int64_t x_stride, const T* res, int64_t res_stride, const W* w, T* y,
              T* h_out, float* rstd_out, int64_t row_begin, int64_t row_end, int64_t hidden,
              float eps, bool stock, std::vector<float>& buf) {
    for (int64_t row = row_begin; row < row_end; ++row) {
        const T* xr = x + row * x_stride;
        float acc[kLanes] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        if (res != nullptr) {
            const T* rr = res + row * res_stride;
            T* hr = h_out + row * hidden;
            for (int64_t c = 0; c < hidden; ++c) {
                const T hv = static_cast<T>(static_cast<float>(xr[c]) + static_cast<float>(rr[c]));
                hr[c] = hv;
                buf[c] = static_cast<float>(hv);
            }
        } else {
            for (int64_t c = 0; c < hidden; ++c) buf[c] = static_cast<float>(xr[c]);
        }
        for (int64_t c = 0; c < hidden; ++c) acc[c % kLanes] += buf[c] * buf[c];
        const float rstd = 1.f / std::sqrt(lane_sum(acc) / static_cast<float>(hidden) + eps);
        rstd_out[row] = rstd;
        T* yr = y + row * hidden;
        if (stock) {
            for (int64_t c = 0; c < hidden; ++c) {
                yr[c] = static_cast<T>(lf_round_to<T>(buf[c] * rstd) * static_cast<float>(w[c]));
            }
        } else {
            for (int64_t c = 0; c < hidden; ++c) {
                yr[c] = static_cast<T>(buf[c] * rstd * static_cast<float>(w[c]));
            }
        }
    }
}

template <typename T, typename W>
void bwd_rows(const T* dy, const T* h, int64_t h_stride, const float* rstd_in, const W* w,
              const T* dres, T* dx, float* dw_acc, int64_t row_begin, int64_t row_end,
              int64_t hidden, bool stock, std::vector<float>& xhat, std::vector<float>& g) {
    constexpr bool kSameType = std::is_same_v<T, W>;  // autograd stores dy * rnd(xhat) in T when w is T
    for (int64_t row = row_begin; row < row_end; ++row) {
        const T* hr = h + row * h_stride;
        const T* dyr = dy + row * hidden;
        const float rstd = rstd_in[row];
        float acc[kLanes] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        if (stock) {
            for (int64_t c = 0; c < hidden; ++c) {
                const float d = static_cast<float>(dyr[c]);
                xhat[c] = static_cast<float>(hr[c]) * rstd;
                g[c] = lf_round_to<T>(d * static_cast<float>(w[c]));  // the gradient of the stored rnd(xhat)
                const float p = d * lf_round_to<T>(xhat[c]);
                dw_acc[c] += kSameType ? lf_round_to<T>(p) : p;
            }
        } else {
            for (int64_t c = 0; c < hidden; ++c) {
                const float d = static_cast<float>(dyr[c]);
                xhat[c] = static_cast<float>(hr[c]) * rstd;
                g[c] = d * static_cast<float>(w[c]);
                dw_acc[c] += d * xhat[c];
            }
        }
        for (int64_t c = 0; c < hidden; ++c) acc[c % kLanes] += xhat[c] * g[c];
        const float dot = lane_sum(acc) / static_cast<float>(hidden);
        T* dxr = dx + row * hidden;
        if (dres != nullptr) {
            const T* drr = dres + row * hidden;
            for (int64_t c = 0; c < hidden; ++c) {
                dxr[c] = static_cast<T>(rstd * (g[c] - xhat[c] * dot) + static_cast<float>(drr[c]));
            }
        } else {
            for (int64_t c = 0; c < hidden; ++c) {
                dxr[c] = static_cast<T>(rstd * (g[c] - xhat[c] * dot));
            }
        }
    }
}

}  // namespace

std::vector<at::Tensor> rmsnorm_fwd_cpu(const at::Tensor& x,
                                        const c10::optional<at::Tensor>& residual,
                                        const at::Tensor& weight, double eps, bool stock_rounding) {
    check_rmsnorm_fwd_args(x, residual, weight, eps, c10::DeviceType::CPU);
    const bool has_res = residual.has_value() && residual->defined();
    const int64_t rows = x.size(0);
    const int64_t hidden = x.size(1);
    auto y = at::empty({rows, hidden}, x.options());
    auto h_out = has_res ? at::empty({rows, hidden}, x.options()) : at::Tensor();
    auto rstd = at::empty({rows}, x.options().dtype(at::kFloat));
    LF_DISPATCH_FLOATING(x.scalar_type(), "rmsnorm_fwd_cpu", [&] {
        using T = scalar_t;
        dispatch_weight<T>(weight, "rmsnorm_fwd_cpu", [&]<typename W>() {
            const T* rp = has_res ? residual->data_ptr<T>() : nullptr;
            const int64_t rs = has_res ? residual->stride(0) : 0;
            T* hp = has_res ? h_out.data_ptr<T>() : nullptr;
            at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
                std::vector<float> buf(hidden);
                fwd_rows<T, W>(x.data_ptr<T>(), x.stride(0), rp, rs, weight.data_ptr<W>(),
                               y.data_ptr<T>(), hp, rstd.data_ptr<float>(), begin, end, hidden,
                               static_cast<float>(eps), stock_rounding, buf);
            });
        });
    });
    return {y, h_out, rstd};
}

std::vector<at::Tensor> rmsnorm_bwd_cpu(const at::Tensor& dy, const at::Tensor& h,
                                        const at::Tensor& rstd, const at::Tensor& weight,
                                        const c10::optional<at::Tensor>& dresidual, bool stock_rounding) {
    check_rmsnorm_bwd_args(dy, h, rstd, weight, dresidual, c10::DeviceType::CPU);
    const bool has_dres = dresidual.has_value() && dresidual->defined();
    const int64_t rows = h.size(0);
    const int64_t hidden = h.size(1);
    auto dx = at::empty({rows, hidden}, h.options());
    const int64_t chunks = std::max<int64_t>(1, std::min(rows, kMaxDwChunks));
    auto partial = at::zeros({chunks, hidden}, h.options().dtype(at::kFloat));
    auto dw = at::empty_like(weight);
    LF_DISPATCH_FLOATING(h.scalar_type(), "rmsnorm_bwd_cpu", [&] {
        using T = scalar_t;
        dispatch_weight<T>(weight, "rmsnorm_bwd_cpu", [&]<typename W>() {
            const T* drp = has_dres ? dresidual->data_ptr<T>() : nullptr;
            float* pp = partial.data_ptr<float>();
            at::parallel_for(0, chunks, 1, [&](int64_t cbegin, int64_t cend) {
                std::vector<float> xhat(hidden), g(hidden);
                for (int64_t chunk = cbegin; chunk < cend; ++chunk) {
                    const int64_t rb = rows * chunk / chunks;
                    const int64_t re = rows * (chunk + 1) / chunks;
                    bwd_rows<T, W>(dy.data_ptr<T>(), h.data_ptr<T>(), h.stride(0),
                                   rstd.data_ptr<float>(), weight.data_ptr<W>(), drp,
                                   dx.data_ptr<T>(), pp + chunk * hidden, rb, re, hidden, stock_rounding, xhat,
                                   g);
                }
            });
            W* dwp = dw.data_ptr<W>();
            for (int64_t c = 0; c < hidden; ++c) {
                float s = 0.f;
                for (int64_t chunk = 0; chunk < chunks; ++chunk) s += pp[chunk * hidden + c];
                dwp[c] = static_cast<W>(s);
            }
        });
    });
    return {dx, dw};
}

}  // namespace loongforge
