// Argument checks of the MoE dispatch entry points (permute / unpermute, forward and backward), shared by
// the CPU and CUDA builds so both reject the same inputs with the same messages. `device` is where every
// tensor must live. Legend: T tokens, K experts per token, P = T*K pairs in expert-major order, H hidden.
#pragma once

#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "lf_common.h"

namespace loongforge {

inline void check_dispatch_tensor_on(const at::Tensor& t, const at::Tensor& first, const char* op, const char* name,
                                     c10::DeviceType device) {
    LF_CHECK(t.device().type() == device, op, ": ", name, " must be on ", device, ", got a tensor on ",
                t.device());
    LF_CHECK(t.device() == first.device(), op, ": ", name, " is on ", t.device(), " but the rows are on ",
                first.device());
}

// The floating dtypes the kernels are built for.
inline void check_kernel_dtype(at::ScalarType dtype, const char* op, const char* name) {
    LF_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, op, ": ", name,
             " must be float32, float16 or bfloat16, got ", dtype);
}

// Activation rows [R, H]: float dtype, unit stride along H (a row stride is allowed).
inline void check_dispatch_rows(const at::Tensor& rows, const char* op, const char* name, c10::DeviceType device) {
    check_dispatch_tensor_on(rows, rows, op, name, device);
    LF_CHECK(rows.dim() == 2 && (rows.size(1) <= 1 || rows.stride(1) == 1), op, ": ", name,
                " must be a 2-D view with unit stride along the last dimension, got shape ", rows.sizes(),
                " and strides ", rows.strides());
    check_kernel_dtype(rows.scalar_type(), op, name);
    LF_CHECK(rows.size(1) <= std::numeric_limits<int>::max(), op, ": hidden size must be below 2^31, got ",
                rows.size(1));
}

// slot_TK [T, K] int64, as routing_indices returns it, on the device of `rows`.
inline void check_dispatch_slot(const at::Tensor& slot_TK, const at::Tensor& rows, const char* op,
                                c10::DeviceType device) {
    check_dispatch_tensor_on(slot_TK, rows, op, "slot_TK", device);
    LF_CHECK_DIM(slot_TK, 2);
    LF_CHECK_CONTIGUOUS(slot_TK);
    LF_CHECK_DTYPE(slot_TK, at::kLong);
    LF_CHECK(slot_TK.size(1) <= std::numeric_limits<int>::max(), op, ": K must be below 2^31, got ",
                slot_TK.size(1));
}

inline void check_pair_rows(const at::Tensor& rows_PH, const at::Tensor& slot_TK, const char* op, const char* name) {
    LF_CHECK(rows_PH.size(0) == slot_TK.numel(), op, ": ", name, " has ", rows_PH.size(0),
                " rows but slot_TK ", slot_TK.sizes(), " holds T*K = ", slot_TK.numel(), " pairs");
}

inline void check_token_rows(const at::Tensor& rows_TH, const at::Tensor& slot_TK, const char* op, const char* name) {
    LF_CHECK(rows_TH.size(0) == slot_TK.size(0), op, ": ", name, " has ", rows_TH.size(0),
                " rows (tokens) but slot_TK ", slot_TK.sizes(), " has ", slot_TK.size(0));
}

// weights_TK [T, K] float32 (the router's output; the Python op casts other dtypes).
inline void check_dispatch_weights(const at::Tensor& weights_TK, const at::Tensor& slot_TK, const at::Tensor& rows,
                                   const char* op, c10::DeviceType device) {
    check_dispatch_tensor_on(weights_TK, rows, op, "weights_TK", device);
    LF_CHECK_CONTIGUOUS(weights_TK);
    LF_CHECK_DTYPE(weights_TK, at::kFloat);
    LF_CHECK(weights_TK.sizes() == slot_TK.sizes(), op, ": weights_TK shape ", weights_TK.sizes(),
                " differs from slot_TK shape ", slot_TK.sizes());
}

inline void check_permute_fwd_args(const at::Tensor& x_TH, const at::Tensor& slot_TK, c10::DeviceType device) {
    check_dispatch_rows(x_TH, "moe_permute", "x_TH", device);
    check_dispatch_slot(slot_TK, x_TH, "moe_permute", device);
    check_token_rows(x_TH, slot_TK, "moe_permute", "x_TH");
}

inline void check_permute_bwd_args(const at::Tensor& dx_PH, const at::Tensor& slot_TK, c10::DeviceType device) {
    check_dispatch_rows(dx_PH, "moe_permute_bwd", "grad of x_PH", device);
    check_dispatch_slot(slot_TK, dx_PH, "moe_permute_bwd", device);
    check_pair_rows(dx_PH, slot_TK, "moe_permute_bwd", "grad of x_PH");
}

inline void check_unpermute_fwd_args(const at::Tensor& y_PH, const at::Tensor& slot_TK, const at::Tensor& weights_TK,
                                     const c10::optional<at::Tensor>& residual_TH, c10::DeviceType device) {
    check_dispatch_rows(y_PH, "moe_unpermute", "y_PH", device);
    check_dispatch_slot(slot_TK, y_PH, "moe_unpermute", device);
    check_pair_rows(y_PH, slot_TK, "moe_unpermute", "y_PH");
    check_dispatch_weights(weights_TK, slot_TK, y_PH, "moe_unpermute", device);
    if (residual_TH.has_value() && residual_TH->defined()) {
        check_dispatch_rows(*residual_TH, "moe_unpermute", "residual_TH", device);
        check_dispatch_tensor_on(*residual_TH, y_PH, "moe_unpermute", "residual_TH", device);
        check_token_rows(*residual_TH, slot_TK, "moe_unpermute", "residual_TH");
        LF_CHECK(residual_TH->size(1) == y_PH.size(1) && residual_TH->scalar_type() == y_PH.scalar_type(),
                 "moe_unpermute: residual_TH (hidden ", residual_TH->size(1), ", ", residual_TH->scalar_type(),
                 ") must match y_PH (hidden ", y_PH.size(1), ", ", y_PH.scalar_type(), ")");
    }
}

inline void check_unpermute_bwd_args(const at::Tensor& dout_TH, const c10::optional<at::Tensor>& y_PH,
                                     const at::Tensor& slot_TK, const at::Tensor& weights_TK,
                                     c10::DeviceType device) {
    const char* op = "moe_unpermute_bwd";
    check_dispatch_rows(dout_TH, op, "grad of out_TH", device);
    check_dispatch_slot(slot_TK, dout_TH, op, device);
    check_token_rows(dout_TH, slot_TK, op, "grad of out_TH");
    check_dispatch_weights(weights_TK, slot_TK, dout_TH, op, device);
    if (y_PH.has_value() && y_PH->defined()) {
        check_dispatch_rows(*y_PH, op, "y_PH", device);
        check_dispatch_tensor_on(*y_PH, dout_TH, op, "y_PH", device);
        check_pair_rows(*y_PH, slot_TK, op, "y_PH");
        LF_CHECK(y_PH->size(1) == dout_TH.size(1) && y_PH->scalar_type() == dout_TH.scalar_type(), op,
                    ": y_PH (hidden ", y_PH->size(1), ", ", y_PH->scalar_type(), ") must match the grad of out_TH (hidden ",
                    dout_TH.size(1), ", ", dout_TH.scalar_type(), ")");
    }
}

// The CUDA routing kernels keep one counter per expert (and one for out-of-range ids) in shared memory.
constexpr int64_t kMaxRoutingExperts = 8192;

// ids_TK [T, K] contiguous int64 expert ids; P = T*K below 2^31 (positions and grouped-GEMM offsets are int32).
inline void check_routing_args(const at::Tensor& ids_TK, int64_t num_experts, c10::DeviceType device) {
    const char* op = "moe_routing_indices";
    LF_CHECK(ids_TK.device().type() == device, op, ": ids_TK must be on ", device, ", got a tensor on ",
             ids_TK.device());
    LF_CHECK_DIM(ids_TK, 2);
    LF_CHECK_CONTIGUOUS(ids_TK);
    LF_CHECK_DTYPE(ids_TK, at::kLong);
    LF_CHECK(num_experts >= 1, op, ": num_experts must be >= 1, got ", num_experts);
    LF_CHECK(ids_TK.numel() < std::numeric_limits<int>::max(), op, ": T*K = ", ids_TK.numel(),
             " pairs; at most 2^31 - 2 are supported (int32 grouped-GEMM offsets)");
    LF_CHECK(device != c10::DeviceType::CUDA || num_experts <= kMaxRoutingExperts, op, ": num_experts = ",
             num_experts, " is above the CUDA kernel's ", kMaxRoutingExperts,
             " (one shared-memory counter each); use routing_indices_reference");
}

// A [rows, columns] score matrix a CUDA/CPU kernel reads row by row (the router's logits, the balancing loss's
// probabilities): on `device`, 2-D, contiguous, a kernel dtype, 1 to max_columns columns (`noun` names them in
// the message, `fallback` is the reference to use beyond).
inline void check_score_matrix(const at::Tensor& t, const char* op, const char* name, const char* noun,
                               int64_t max_columns, const char* fallback, c10::DeviceType device) {
    LF_CHECK(t.device().type() == device, op, ": ", name, " must be on ", device, ", got a tensor on ", t.device());
    LF_CHECK_DIM(t, 2);
    LF_CHECK_CONTIGUOUS(t);
    check_kernel_dtype(t.scalar_type(), op, name);
    LF_CHECK(t.size(1) >= 1 && t.size(1) <= max_columns, op, ": ", t.size(1), " ", noun, "; the kernels take 1 to ",
             max_columns, " (use ", fallback, ")");
}

// Router top-k (moe_router.cu, moe_router_cpu.cpp): a warp per token, lane j holding the j-th choice.
constexpr int64_t kMaxRouterExperts = 1024;  // 32 values per lane
constexpr int64_t kMaxRouterTopK = 32;       // one choice per lane

inline void check_router_logits(const at::Tensor& logits_TE, int64_t k, c10::DeviceType device) {
    const char* op = "moe_router_topk";
    check_score_matrix(logits_TE, op, "logits_TE", "experts", kMaxRouterExperts, "router_topk_reference", device);
    const int64_t experts = logits_TE.size(1);
    LF_CHECK(k >= 1 && k <= experts && k <= kMaxRouterTopK, op, ": k = ", k, " must be in [1, min(E, ",
             kMaxRouterTopK, ")] with E = ", experts, " (use router_topk_reference above ", kMaxRouterTopK, ")");
}

inline void check_router_bwd_args(const at::Tensor& dweights_TK, const c10::optional<at::Tensor>& dprobs_TE,
                                  const at::Tensor& probs_TE, const at::Tensor& ids_TK, c10::DeviceType device) {
    const char* op = "moe_router_topk_bwd";
    for (const at::Tensor* t : {&dweights_TK, &probs_TE, &ids_TK}) {
        LF_CHECK(t->device() == probs_TE.device() && t->device().type() == device, op,
                 ": every tensor must be on the probabilities' device ", probs_TE.device(), ", got ", t->device());
        LF_CHECK_CONTIGUOUS((*t));
    }
    LF_CHECK_DTYPE(probs_TE, at::kFloat);
    LF_CHECK_DTYPE(dweights_TK, at::kFloat);
    LF_CHECK_DTYPE(ids_TK, at::kLong);
    LF_CHECK(probs_TE.dim() == 2 && probs_TE.size(1) <= kMaxRouterExperts, op, ": probs_TE must be [T, E<=",
             kMaxRouterExperts, "], got ", probs_TE.sizes());
    LF_CHECK(ids_TK.dim() == 2 && ids_TK.size(0) == probs_TE.size(0) && ids_TK.size(1) <= kMaxRouterTopK &&
                 ids_TK.size(1) <= probs_TE.size(1) && dweights_TK.sizes() == ids_TK.sizes(),
             op, ": ids_TK ", ids_TK.sizes(), " and dweights_TK ", dweights_TK.sizes(), " must be [T, K] with K <= ",
             kMaxRouterTopK, " for probs_TE ", probs_TE.sizes());
    if (dprobs_TE.has_value() && dprobs_TE->defined()) {
        LF_CHECK(dprobs_TE->device() == probs_TE.device() && dprobs_TE->sizes() == probs_TE.sizes() &&
                     dprobs_TE->scalar_type() == at::kFloat && dprobs_TE->is_contiguous(),
                 op, ": dprobs_TE must be a contiguous float32 tensor like probs_TE ", probs_TE.sizes(), ", got ",
                 dprobs_TE->sizes(), " ", dprobs_TE->scalar_type(), " on ", dprobs_TE->device());
    }
}

// Top-k choice counts (moe_routing.cu, moe_routing_cpu.cpp): counts_E[e] = sum over rows r whose k largest values
// (torch.topk's set) include column e of weights_R[r % weights_R.numel()] (1 without weights).
constexpr int64_t kMaxTopKCountExperts = 4096;  // one int64 shared-memory counter each on CUDA

inline void check_topk_counts_args(const at::Tensor& values_RE, int64_t k, const c10::optional<at::Tensor>& weights_R,
                                   c10::DeviceType device) {
    const char* op = "moe_topk_counts";
    check_score_matrix(values_RE, op, "values_RE", "columns", kMaxTopKCountExperts, "topk_counts_reference", device);
    const int64_t experts = values_RE.size(1);
    LF_CHECK(k >= 1 && k <= experts, op, ": k = ", k, " must be in [1, ", experts, "] (the number of columns)");
    if (weights_R.has_value() && weights_R->defined()) {
        const at::Tensor& w = *weights_R;
        LF_CHECK(w.device() == values_RE.device(), op, ": weights_R is on ", w.device(), " but values_RE on ",
                 values_RE.device());
        LF_CHECK(w.dim() == 1 && w.is_contiguous() && w.scalar_type() == at::kLong, op,
                 ": weights_R must be a contiguous 1-D int64 tensor, got ", w.scalar_type(), " of shape ", w.sizes());
        LF_CHECK(w.numel() >= 1 && values_RE.size(0) % w.numel() == 0, op, ": weights_R has ", w.numel(),
                 " entries, which must divide the ", values_RE.size(0), " rows (row r takes weights_R[r % ",
                 w.numel(), "])");
    }
}

// torch.topk's order of a value (TopKTypeConfig<float>::convert): the IEEE bits made unsigned-monotonic, -0.0
// below 0.0, every NaN above +inf. Equal keys: the lower column first, as torch.topk's CUDA kernel takes them.
LF_HOST_DEVICE uint32_t topk_order_key(float v) {
    uint32_t x;
#if defined(__CUDA_ARCH__)
    x = __float_as_uint(v);
#else
    std::memcpy(&x, &v, sizeof(x));
#endif
    const uint32_t mask = (x & 0x80000000u) ? 0xffffffffu : 0x80000000u;
    return v == v ? (x ^ mask) : 0xffffffffu;
}

// A column's rank key among its row: its order key above, the lower column winning a tie. Never 0 (the lowest
// order key, -inf's, is 0x007fffff) and never ~0 (columns are below 2^31 - 1).
LF_HOST_DEVICE uint64_t topk_rank_key(float v, int64_t column) {
    return (static_cast<uint64_t>(topk_order_key(v)) << 32) | static_cast<uint32_t>(0xfffffffeu - column);
}

// Expert linear backward (moe_expert_gemm.cpp, moe_expert_gemm_cpu.cpp): y_PO = x_PI @ w_EOI[e]^T on each expert's
// rows, expert-major, group sizes counts (on the host). dy_PO [P, O], x_PI [P, I], w_EOI [E, O, I]: contiguous, one
// kernel dtype, one device; counts: E sizes >= 0 summing to P.
inline void check_expert_linear_bwd_args(const at::Tensor& dy_PO, const at::Tensor& x_PI, const at::Tensor& w_EOI,
                                         const std::vector<int64_t>& counts, c10::DeviceType device) {
    const char* op = "expert_linear_backward";
    const std::pair<const at::Tensor*, const char*> tensors[] = {{&dy_PO, "dy_PO"}, {&x_PI, "x_PI"}, {&w_EOI, "w_EOI"}};
    for (const auto& [t, name] : tensors) {
        check_dispatch_tensor_on(*t, x_PI, op, name, device);
        LF_CHECK(t->is_contiguous(), op, ": ", name, " must be contiguous, got shape ", t->sizes(), " and strides ",
                 t->strides());
        LF_CHECK(t->scalar_type() == x_PI.scalar_type(), op, ": ", name, " is ", t->scalar_type(), " but x_PI is ",
                 x_PI.scalar_type(), " (one dtype for all three)");
    }
    check_kernel_dtype(x_PI.scalar_type(), op, "x_PI");
    LF_CHECK(dy_PO.dim() == 2 && x_PI.dim() == 2 && w_EOI.dim() == 3, op, ": dy_PO [P, O], x_PI [P, I] and w_EOI "
             "[E, O, I] expected, got shapes ", dy_PO.sizes(), ", ", x_PI.sizes(), " and ", w_EOI.sizes());
    LF_CHECK(dy_PO.size(0) == x_PI.size(0) && dy_PO.size(1) == w_EOI.size(1) && x_PI.size(1) == w_EOI.size(2), op,
             ": shapes do not agree: dy_PO ", dy_PO.sizes(), ", x_PI ", x_PI.sizes(), ", w_EOI ", w_EOI.sizes(),
             " (dy_PO [P, O], x_PI [P, I], w_EOI [E, O, I])");
    LF_CHECK(static_cast<int64_t>(counts.size()) == w_EOI.size(0), op, ": ", static_cast<int64_t>(counts.size()),
             " group sizes for ", w_EOI.size(0), " experts");
    int64_t total = 0;
    for (size_t e = 0; e < counts.size(); ++e) {
        LF_CHECK(counts[e] >= 0, op, ": group size of expert ", static_cast<int64_t>(e), " is ", counts[e],
                 "; sizes must be >= 0");
        total += counts[e];
    }
    LF_CHECK(total == x_PI.size(0), op, ": the group sizes sum to ", total, " but x_PI has ", x_PI.size(0),
             " rows; every row must belong to one expert");
}

}  // namespace loongforge
