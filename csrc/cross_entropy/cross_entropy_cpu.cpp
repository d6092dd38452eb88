// Fused softmax cross-entropy on the CPU: the formulas of cross_entropy.cu (fp32 arithmetic on fp32, bf16 or fp16
// logits; nll = log_sum - (x[t] - max),
// p = exp((x - max) - log_sum) with log_sum = log(sum(exp(x - max))); one rounding of the gradient), rows split
// over ATen's thread pool. The max is taken first and the sum after it (two passes instead of the CUDA kernel's
// online pair): a row stays in cache between them.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "cross_entropy_checks.h"

namespace loongforge {
namespace {

constexpr int kLanes = 8;
constexpr int64_t kBlock = 256;

// sum(exp(x - m)) in fp32, blocked: one running sum over 32000 terms drifts by ~1e-5 relative (several times
// torch's error, and the CUDA kernel's, whose partial sums form a tree); 8 lanes per block of 256, then the
// blocks' sums, keep it near torch's.
template <typename X>
float sum_exp(const X* x, float m, int64_t n) {
    float total = 0.f;
    for (int64_t b = 0; b < n; b += kBlock) {
        const int64_t e = std::min(n, b + kBlock);
        float acc[kLanes] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (int64_t i = b; i < e; ++i) acc[(i - b) % kLanes] += std::exp(static_cast<float>(x[i]) - m);
        total += ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    }
    return total;
}

}  // namespace

at::Tensor cross_entropy_cpu(const at::Tensor& logits, const at::Tensor& target, const at::Tensor& valid,
                             const at::Tensor& scale, const c10::optional<at::Tensor>& grad) {
    check_cross_entropy_args(logits, target, valid, scale, grad, c10::DeviceType::CPU);
    const int64_t rows = logits.size(0);
    const int64_t vocab = logits.size(1);
    auto nll = at::empty({rows}, logits.options().dtype(at::kFloat));
    const bool with_grad = grad.has_value() && grad->defined();
    LF_DISPATCH_FLOATING(logits.scalar_type(), "cross_entropy_cpu", [&] {
        using X = scalar_t;
        LF_DISPATCH_FLOATING(with_grad ? grad->scalar_type() : at::kFloat, "cross_entropy_cpu", [&] {
            using G = scalar_t;
            const X* x_all = logits.data_ptr<X>();
            const int64_t x_stride = logits.stride(0);
            const int64_t* target_all = target.data_ptr<int64_t>();
            const bool* valid_all = valid.data_ptr<bool>();
            const float* scale_all = scale.data_ptr<float>();
            float* nll_all = nll.data_ptr<float>();
            G* grad_all = with_grad ? grad->data_ptr<G>() : nullptr;
            const int64_t g_stride = with_grad ? grad->stride(0) : 0;
            // about 32K elements per task, so that small vocabularies do not pay the pool's overhead per row
            const int64_t grain = std::max<int64_t>(1, 32768 / vocab);
            at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
                for (int64_t r = begin; r < end; ++r) {
                    const X* x = x_all + r * x_stride;
                    const int64_t t = target_all[r];
                    LF_CHECK(t >= 0 && t < vocab, "cross_entropy: target ", t, " of row ", r,
                             " is out of bounds for ", vocab, " classes");
                    float m = -INFINITY;
                    for (int64_t i = 0; i < vocab; ++i) m = std::max(m, static_cast<float>(x[i]));
                    const float log_sum = std::log(m == -INFINITY ? 0.f : sum_exp(x, m, vocab));
                    const float x_t = static_cast<float>(x[t]);
                    nll_all[r] = valid_all[r] ? log_sum - (x_t - m) : 0.f;
                    if (grad_all == nullptr) continue;
                    const float s = scale_all[r];
                    G* g = grad_all + r * g_stride;
                    for (int64_t i = 0; i < vocab; ++i) {
                        g[i] = static_cast<G>(std::exp((static_cast<float>(x[i]) - m) - log_sum) * s);
                    }
                    g[t] = static_cast<G>((std::exp((x_t - m) - log_sum) - 1.f) * s);
                }
            });
        });
    });
    return nll;
}

// scale_by on the CPU: the same fp32 product and single rounding as the CUDA kernel.
void scale_by_cpu(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& out) {
    const float s = scale.data_ptr<float>()[0];
    const int64_t n = x.numel();
    LF_DISPATCH_FLOATING(x.scalar_type(), "scale_by", [&] {
        using T = scalar_t;
        const T* src = x.data_ptr<T>();
        T* dst = out.data_ptr<T>();
        at::parallel_for(0, n, 1 << 16, [&](int64_t begin, int64_t end) {
            for (int64_t i = begin; i < end; ++i) dst[i] = static_cast<T>(static_cast<float>(src[i]) * s);
        });
    });
}

}  // namespace loongforge
