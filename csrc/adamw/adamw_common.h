// Fused AdamW + global-norm clipping + non-finite skip: the tensor table both builds read, and the
// per-element arithmetic both builds share, so the CPU and CUDA kernels round the same way.
//
// A bucket is a list of same-layout tensors of one parameter group. Its table is one int64 tensor:
//   header  [kHeader]           n_tensors, n_chunks, param dtype, grad dtype, has_master, chunk_size
//   entries [n_tensors][kEntry] param, master, grad, exp_avg, exp_avg_sq, step (addresses), numel, vec_ok
//   chunks  [n_chunks]          (tensor index << 32) | chunk index within the tensor
// The host keeps a CPU copy (the header decides the launch) and the kernels read a device copy that is
// built once per layout and cached by the caller (ds_loongforge/ops/adamw.py).
//
// stats is a float32 [2] device tensor: [sum of squares of the gradients as stored (still multiplied by
// the loss scale), number of pass-1 partials that saw a non-finite gradient]. Both entries add under an
// all-reduce SUM, so one collective makes the pair global.
#pragma once

#include <cmath>
#include <cstdint>

#include "lf_common.h"

namespace loongforge {
namespace adamw {

constexpr int kHeader = 8;
constexpr int kEntry = 8;
// 64 Ki elements per chunk: a CUDA block of 512 threads makes 32 16-byte steps per chunk, and a 1e9-param
// model has ~15k chunks, enough to fill any GPU; small enough that a 4 Ki-element tensor is one chunk.
constexpr int64_t kChunkSize = 1 << 16;
// Pass 1 writes one partial per block (CUDA) or per worker slot (CPU); a fixed count makes the final
// reduction order, and so the norm, independent of thread scheduling.
constexpr int64_t kMaxPartials = 2048;

enum Field { kParam = 0, kMaster, kGrad, kExpAvg, kExpAvgSq, kStep, kNumel, kVecOk };
enum DtypeCode { kF32 = 0, kBF16 = 1, kF16 = 2 };

// Calls f(T{}) with T the C++ type of a table's dtype code (host side, CPU and CUDA builds alike).
template <typename F>
inline void dispatch_code(int64_t code, const char* what, F&& f) {
    switch (code) {
        case kF32: return f(float{});
        case kBF16: return f(at::BFloat16{});
        case kF16: return f(at::Half{});
        default: LF_CHECK(false, "fused_adamw_clip: bad ", what, " dtype code ", code, " in the table");
    }
}

struct TableHeader {
    int64_t n_tensors, n_chunks, param_dtype, grad_dtype, has_master, chunk_size;
};

inline TableHeader read_header(const at::Tensor& cpu_table) {
    LF_CHECK(cpu_table.device().is_cpu() && cpu_table.scalar_type() == at::kLong && cpu_table.dim() == 1 &&
                    cpu_table.numel() >= kHeader,
                "fused_adamw_clip: cpu_table must be the CPU int64 table make_table returned, got ",
                cpu_table.scalar_type(), " tensor of shape ", cpu_table.sizes(), " on ", cpu_table.device());
    const int64_t* h = cpu_table.data_ptr<int64_t>();
    TableHeader header{h[0], h[1], h[2], h[3], h[4], h[5]};
    LF_CHECK(cpu_table.numel() == kHeader + header.n_tensors * kEntry + header.n_chunks,
                "fused_adamw_clip: table of ", cpu_table.numel(), " entries does not match its header (",
                header.n_tensors, " tensors, ", header.n_chunks, " chunks)");
    return header;
}

inline int64_t num_partials(const TableHeader& h) { return h.n_chunks < kMaxPartials ? h.n_chunks : kMaxPartials; }

// Hyper-parameters of one call (one parameter group), with the clip and the inverse loss scale.
struct Hyper {
    double lr, beta1, beta2, eps, weight_decay, max_norm, clip_eps, inv_scale;
};

// The float scalars of one tensor's update at step `step` (the count after this update), computed in
// double like torch.optim.AdamW computes them in Python, then rounded once.
struct StepScalars {
    float decay, lerp_w, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size;
};

LF_HOST_DEVICE StepScalars step_scalars(const Hyper& h, float step) {
    const double bc1 = 1.0 - pow(h.beta1, static_cast<double>(step));
    const double bc2 = 1.0 - pow(h.beta2, static_cast<double>(step));
    StepScalars s;
    s.decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
    s.lerp_w = static_cast<float>(1.0 - h.beta1);
    s.beta2 = static_cast<float>(h.beta2);
    s.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
    s.bc2_sqrt = static_cast<float>(sqrt(bc2));
    s.eps = static_cast<float>(h.eps);
    s.neg_step_size = static_cast<float>(-(h.lr / bc1));
    return s;
}

// min(1, max_norm / (norm + clip_eps)) times the inverse loss scale; no clipping when max_norm <= 0.
// The inverse loss scale is h.inv_scale (host) times dev_inv (read from the device by the caller: a dynamic
// fp16 loss scale that lives on the device, 1 when there is none).
// A squared norm that overflowed to inf while every gradient is finite gives 0 (as torch's
// clip_grad_norm_ does): the step then only decays the moments and the weights.
LF_HOST_DEVICE float grad_scale(const Hyper& h, float norm_sq, float dev_inv) {
    const float inv = static_cast<float>(h.inv_scale) * dev_inv;
    float coef = 1.f;
    if (h.max_norm > 0.0) {
        const float norm = sqrtf(norm_sq) * inv;
        const float c = static_cast<float>(h.max_norm) / (norm + static_cast<float>(h.clip_eps));
        coef = c < 1.f ? c : 1.f;
    }
    return coef * inv;
}

// torch.optim.AdamW's single-tensor update in fp32, operation for operation: decoupled decay, lerp of the
// first moment, addcmul of the second, addcdiv with the bias-corrected step size.
LF_HOST_DEVICE void adamw_element(float& p, float& m, float& v, float g, const StepScalars& s) {
    p = p * s.decay;
    m = s.lerp_w < 0.5f ? m + s.lerp_w * (g - m) : g - (g - m) * (1.f - s.lerp_w);
    v = v * s.beta2 + s.one_minus_beta2 * (g * g);
    const float denom = sqrtf(v) / s.bc2_sqrt + s.eps;
    p = p + s.neg_step_size * (m / denom);
}

}  // namespace adamw
}  // namespace loongforge
