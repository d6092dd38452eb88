// Fused AdamW + global-norm clip on the CPU: the same table, partial layout and per-element arithmetic as
// adamw.cu (adamw_common.h), so the two builds agree to rounding and each is deterministic.
#include <ATen/Parallel.h>

#include <cmath>

#include "adamw_common.h"

namespace loongforge {
namespace adamw {
namespace {

struct Chunk {
    const int64_t* entry;
    int64_t begin, end;
};

inline Chunk chunk_at(const int64_t* table, const TableHeader& h, int64_t c) {
    const int64_t* entries = table + kHeader;
    const int64_t word = entries[h.n_tensors * kEntry + c];
    const int64_t* e = entries + (word >> 32) * kEntry;
    const int64_t begin = (word & 0xffffffff) * h.chunk_size;
    const int64_t end = begin + h.chunk_size < e[kNumel] ? begin + h.chunk_size : e[kNumel];
    return {e, begin, end};
}

template <typename T>
inline T* ptr(const int64_t* e, Field f) {
    return reinterpret_cast<T*>(static_cast<uintptr_t>(e[f]));
}

// Sum of squares of g[begin, end): 8 lanes per 1 Ki-element block, blocks added in order, which keeps the
// fp32 rounding error near that of a pairwise sum at the cost of nothing.
template <typename G>
float chunk_sumsq(const G* g, int64_t begin, int64_t end, bool& nonfinite) {
    constexpr int kLanes = 8;
    constexpr int64_t kBlock = 1024;
    float total = 0.f;
    bool bad = false;
    for (int64_t b = begin; b < end; b += kBlock) {
        const int64_t stop = b + kBlock < end ? b + kBlock : end;
        float lanes[kLanes] = {};
        int64_t i = b;
        for (; i + kLanes <= stop; i += kLanes) {
            for (int l = 0; l < kLanes; ++l) {
                const float x = static_cast<float>(g[i + l]);
                lanes[l] += x * x;
                bad |= !std::isfinite(x);
            }
        }
        for (; i < stop; ++i) {
            const float x = static_cast<float>(g[i]);
            lanes[0] += x * x;
            bad |= !std::isfinite(x);
        }
        float block = 0.f;
        for (int l = 0; l < kLanes; ++l) block += lanes[l];
        total += block;
    }
    nonfinite = nonfinite || bad;
    return total;
}

}  // namespace

void sumsq_partials_cpu(const TableHeader& h, const at::Tensor& dev_table, const at::Tensor& partials,
                        const at::Tensor& flags) {
    const int64_t* table = dev_table.data_ptr<int64_t>();
    float* part = partials.data_ptr<float>();
    float* flag = flags.data_ptr<float>();
    const int64_t p_count = partials.numel();
    dispatch_code(h.grad_dtype, "grad", [&](auto g_tag) {
        using G = decltype(g_tag);
        at::parallel_for(0, p_count, 1, [&](int64_t p_begin, int64_t p_end) {
            for (int64_t p = p_begin; p < p_end; ++p) {
                float acc = 0.f;
                bool bad = false;
                for (int64_t c = p; c < h.n_chunks; c += p_count) {
                    const Chunk ch = chunk_at(table, h, c);
                    acc += chunk_sumsq(ptr<const G>(ch.entry, kGrad), ch.begin, ch.end, bad);
                }
                part[p] = acc;
                flag[p] = bad ? 1.f : 0.f;
            }
        });
    });
}

void reduce_partials_cpu(const at::Tensor& partials, const at::Tensor& flags, const at::Tensor& stats) {
    const float* part = partials.data_ptr<float>();
    const float* flag = flags.data_ptr<float>();
    float sum = 0.f, bad = 0.f;
    for (int64_t i = 0; i < partials.numel(); ++i) {
        sum += part[i];
        bad += flag[i];
    }
    float* s = stats.data_ptr<float>();
    s[0] = sum;
    s[1] = bad;
}

void adamw_update_cpu(const TableHeader& h, const at::Tensor& dev_table, const at::Tensor& stats,
                      const float* inv_scale_dev, const Hyper& hp) {
    const float* s = stats.data_ptr<float>();
    if (s[1] != 0.f) return;
    const float scale = grad_scale(hp, s[0], inv_scale_dev != nullptr ? *inv_scale_dev : 1.f);
    const int64_t* table = dev_table.data_ptr<int64_t>();
    dispatch_code(h.param_dtype, "param", [&](auto p_tag) {
        using P = decltype(p_tag);
        dispatch_code(h.grad_dtype, "grad", [&](auto g_tag) {
            using G = decltype(g_tag);
            at::parallel_for(0, h.n_chunks, 1, [&](int64_t c_begin, int64_t c_end) {
                for (int64_t c = c_begin; c < c_end; ++c) {
                    const Chunk ch = chunk_at(table, h, c);
                    const int64_t* e = ch.entry;
                    const StepScalars sc = step_scalars(hp, *ptr<const float>(e, kStep) + 1.f);
                    P* param = ptr<P>(e, kParam);
                    float* master = ptr<float>(e, kMaster);
                    const G* grad = ptr<const G>(e, kGrad);
                    float* m = ptr<float>(e, kExpAvg);
                    float* v = ptr<float>(e, kExpAvgSq);
                    for (int64_t i = ch.begin; i < ch.end; ++i) {
                        float p = master != nullptr ? master[i] : static_cast<float>(param[i]);
                        adamw_element(p, m[i], v[i], static_cast<float>(grad[i]) * scale, sc);
                        if (master != nullptr) master[i] = p;
                        param[i] = static_cast<P>(p);
                    }
                }
            });
        });
    });
    const int64_t* entries = table + kHeader;
    for (int64_t t = 0; t < h.n_tensors; ++t) *ptr<float>(entries + t * kEntry, kStep) += 1.f;
}

}  // namespace adamw
}  // namespace loongforge
