// Fused SwiGLU + dropout on the CPU: same formulas and the same Philox mask as swiglu.cu, so CPU and
// CUDA results agree bit for bit in the mask and to rounding in the values. Both roundings of
// swiglu_kernels.cuh: "once" (stock_rounding == false) computes each output in fp32 and rounds it once;
// "stock" rounds 16-bit intermediates where transformers' eager `silu(gate) * up` and its autograd do
// (rnd = lf_round_to<T>):
//   forward:  a = rnd(g / (1 + exp(-g)));  h = rnd(a * u);  out = keep ? rnd(h * scale) : 0
//   backward: dh = keep ? rnd(dout * scale) : 0;  du = rnd(dh * a);  dg = rnd(rnd(dh * u) * s * (1 + g * (1 - s)))
// Float32 tensors run the once code under both (every rnd would be the identity).
#include <ATen/Parallel.h>

#include <cmath>

#include "swiglu_checks.h"

namespace loongforge {
namespace {

inline float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }

// torch's silu expression, rounded to T by the stock rounding (x * sigmoid(x) rounds to other T values at times)
inline float silu(float x) { return x / (1.f + std::exp(-x)); }

struct MaskRow {
    uint64_t seed, offset;
    uint32_t threshold;
    // keep bit of flat element e; caches the last Philox block so each block is drawn once
    uint64_t cached_block = ~uint64_t{0};
    Philox4 words{};
    bool keep(uint64_t e) {
        const uint64_t block = e / 4;
        if (block != cached_block) {
            words = dropout_words(seed, offset, block);
            cached_block = block;
        }
        return words.v[e % 4] < threshold;
    }
};

}  // namespace

at::Tensor swiglu_fwd_cpu(const at::Tensor& gate_up, double p, int64_t seed, int64_t offset,
                          bool stock_rounding) {
    check_swiglu_fwd_args(gate_up, p, c10::DeviceType::CPU);
    const int64_t rows = gate_up.size(0);
    const int64_t inter = gate_up.size(1) / 2;
    auto out = at::empty({rows, inter}, gate_up.options());
    const bool dropout = p > 0.0;
    const uint32_t threshold = dropout ? keep_threshold_from_p(p) : 0u;
    const float scale = static_cast<float>(1.0 / (1.0 - p));
    LF_DISPATCH_FLOATING(gate_up.scalar_type(), "swiglu_fwd_cpu", [&] {
        using T = scalar_t;
        const bool stock = stock_rounding && sizeof(T) < sizeof(float);
        const T* in = gate_up.data_ptr<T>();
        T* o = out.data_ptr<T>();
        const int64_t stride = gate_up.stride(0);
        at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
            MaskRow mask{static_cast<uint64_t>(seed), static_cast<uint64_t>(offset), threshold};
            for (int64_t n = begin; n < end; ++n) {
                const T* g = in + n * stride;
                const T* u = g + inter;
                T* orow = o + n * inter;
                for (int64_t i = 0; i < inter; ++i) {
                    const float gf = static_cast<float>(g[i]);
                    if (stock) {  // the store rounds the last product
                        float v = lf_round_to<T>(silu(gf)) * static_cast<float>(u[i]);
                        if (dropout) {
                            v = mask.keep(static_cast<uint64_t>(n * inter + i)) ? lf_round_to<T>(v) * scale : 0.f;
                        }
                        orow[i] = static_cast<T>(v);
                        continue;
                    }
                    float v = gf * sigmoid(gf) * static_cast<float>(u[i]);
                    if (dropout) v = mask.keep(static_cast<uint64_t>(n * inter + i)) ? v * scale : 0.f;
                    orow[i] = static_cast<T>(v);
                }
            }
        });
    });
    return out;
}

at::Tensor swiglu_bwd_cpu(const at::Tensor& dout, const at::Tensor& gate_up, double p, int64_t seed,
                          int64_t offset, bool stock_rounding) {
    check_swiglu_bwd_args(dout, gate_up, p, c10::DeviceType::CPU);
    const int64_t rows = gate_up.size(0);
    const int64_t inter = gate_up.size(1) / 2;
    auto dgate_up = at::empty({rows, 2 * inter}, gate_up.options());
    const bool dropout = p > 0.0;
    const uint32_t threshold = dropout ? keep_threshold_from_p(p) : 0u;
    const float scale = static_cast<float>(1.0 / (1.0 - p));
    LF_DISPATCH_FLOATING(gate_up.scalar_type(), "swiglu_bwd_cpu", [&] {
        using T = scalar_t;
        const bool stock = stock_rounding && sizeof(T) < sizeof(float);
        const T* in = gate_up.data_ptr<T>();
        const T* dz_all = dout.data_ptr<T>();
        T* d_all = dgate_up.data_ptr<T>();
        const int64_t stride = gate_up.stride(0);
        at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
            MaskRow mask{static_cast<uint64_t>(seed), static_cast<uint64_t>(offset), threshold};
            for (int64_t n = begin; n < end; ++n) {
                const T* g = in + n * stride;
                const T* u = g + inter;
                const T* dz_row = dz_all + n * inter;
                T* dg = d_all + n * 2 * inter;
                T* du = dg + inter;
                for (int64_t i = 0; i < inter; ++i) {
                    const float gf = static_cast<float>(g[i]);
                    const float uf = static_cast<float>(u[i]);
                    float dz = static_cast<float>(dz_row[i]);
                    if (dropout) dz = mask.keep(static_cast<uint64_t>(n * inter + i)) ? dz * scale : 0.f;
                    const float s = sigmoid(gf);
                    if (stock) {
                        if (dropout) dz = lf_round_to<T>(dz);  // autograd stores dout * scale in T
                        dg[i] = static_cast<T>(lf_round_to<T>(dz * uf) * s * (1.f + gf * (1.f - s)));
                        du[i] = static_cast<T>(dz * lf_round_to<T>(silu(gf)));
                        continue;
                    }
                    dg[i] = static_cast<T>(dz * uf * s * (1.f + gf * (1.f - s)));
                    du[i] = static_cast<T>(dz * gf * s);
                }
            }
        });
    });
    return dgate_up;
}

}  // namespace loongforge
