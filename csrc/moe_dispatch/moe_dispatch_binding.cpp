// Python binding of the fused MoE dispatch ops (permute / unpermute, forward and backward, and the routing
// indices they take). The entry points check their arguments and allocate here, once for both builds; each
// build supplies the two row kernels they are made of (moe_dispatch.cu on CUDA, moe_dispatch_cpu.cpp on the CPU)
// and the routing sort (moe_routing.cu, moe_routing_cpu.cpp):
//   scatter: dst_PH[slot_TK[t, j]] = w[t, j] * src_TH[t]  (+ dweights_TK[t, j] = src_TH[t] . y_PH[slot_TK[t, j]])
//   gather:  dst_TH[t] = r[t] + sum_j w[t, j] * src_PH[slot_TK[t, j]]           (fp32, one rounding)
// An undefined weights_TK means w = 1; an undefined y_PH skips dweights; an undefined residual_TH means r = 0.
// pybind11 with torch's Tensor/optional casters only: torch/extension.h (all of libtorch's C++ API)
// made a binding the slowest unit of a cold build (26 s vs 10 s on 2 cores).
#include <torch/csrc/utils/pybind.h>

#include "moe_dispatch_checks.h"

namespace loongforge {
#ifdef LF_WITH_CUDA
void moe_scatter_rows_cuda(const at::Tensor& src_TH, const at::Tensor& slot_TK, const at::Tensor& weights_TK,
                           const at::Tensor& dst_PH, const at::Tensor& y_PH, const at::Tensor& dweights_TK);
void moe_gather_rows_cuda(const at::Tensor& src_PH, const at::Tensor& slot_TK, const at::Tensor& weights_TK,
                          const at::Tensor& residual_TH, const at::Tensor& dst_TH, bool stock,
                         bool round_products);
void moe_routing_indices_cuda(const at::Tensor& ids_TK, int64_t num_experts, const at::Tensor& order_P,
                              const at::Tensor& slot_TK, const at::Tensor& counts_E, const at::Tensor& offsets_E);
void moe_router_topk_fwd_cuda(const at::Tensor& logits_TE, int64_t k, bool renormalize, const at::Tensor& probs_TE,
                              const at::Tensor& weights_TK, const at::Tensor& ids_TK);
void moe_router_topk_bwd_cuda(const at::Tensor& dweights_TK, const at::Tensor& dprobs_TE, const at::Tensor& probs_TE,
                              const at::Tensor& ids_TK, bool renormalize, const at::Tensor& dlogits_TE);
void moe_topk_counts_cuda(const at::Tensor& values_RE, int64_t k, const at::Tensor& weights_R,
                          const at::Tensor& counts_E);
const char* expert_gemm_backend_cuda();
std::vector<int64_t> expert_gemm_stats_cuda();
std::vector<int64_t> expert_gemm_heuristic_cuda(const at::Tensor& like, bool wgrad, int64_t m, int64_t fixed,
                                                int64_t rows);
void expert_linear_bwd_cuda(const at::Tensor& dy_PO, const at::Tensor& x_PI, const at::Tensor& w_EOI,
                            const std::vector<int64_t>& counts, int64_t row_bucket, const at::Tensor& dx_PI,
                            const at::Tensor& dw_EOI);
#define LF_EXPERT_LINEAR_BWD expert_linear_bwd_cuda
#define LF_EXPERT_GEMM_BACKEND expert_gemm_backend_cuda
#define LF_TOPK_COUNTS moe_topk_counts_cuda
#define LF_ROUTER_FWD moe_router_topk_fwd_cuda
#define LF_ROUTER_BWD moe_router_topk_bwd_cuda
#define LF_SCATTER_ROWS moe_scatter_rows_cuda
#define LF_GATHER_ROWS moe_gather_rows_cuda
#define LF_ROUTING_INDICES moe_routing_indices_cuda
#define LF_DEVICE "cuda"
constexpr c10::DeviceType kDispatchDevice = c10::DeviceType::CUDA;
#else
void moe_scatter_rows_cpu(const at::Tensor& src_TH, const at::Tensor& slot_TK, const at::Tensor& weights_TK,
                          const at::Tensor& dst_PH, const at::Tensor& y_PH, const at::Tensor& dweights_TK);
void moe_gather_rows_cpu(const at::Tensor& src_PH, const at::Tensor& slot_TK, const at::Tensor& weights_TK,
                         const at::Tensor& residual_TH, const at::Tensor& dst_TH, bool stock,
                         bool round_products);
void moe_routing_indices_cpu(const at::Tensor& ids_TK, int64_t num_experts, const at::Tensor& order_P,
                             const at::Tensor& slot_TK, const at::Tensor& counts_E, const at::Tensor& offsets_E);
void moe_router_topk_fwd_cpu(const at::Tensor& logits_TE, int64_t k, bool renormalize, const at::Tensor& probs_TE,
                             const at::Tensor& weights_TK, const at::Tensor& ids_TK);
void moe_router_topk_bwd_cpu(const at::Tensor& dweights_TK, const at::Tensor& dprobs_TE, const at::Tensor& probs_TE,
                             const at::Tensor& ids_TK, bool renormalize, const at::Tensor& dlogits_TE);
void moe_topk_counts_cpu(const at::Tensor& values_RE, int64_t k, const at::Tensor& weights_R,
                         const at::Tensor& counts_E);
const char* expert_gemm_backend_cpu();
void expert_linear_bwd_cpu(const at::Tensor& dy_PO, const at::Tensor& x_PI, const at::Tensor& w_EOI,
                           const std::vector<int64_t>& counts, int64_t row_bucket, const at::Tensor& dx_PI,
                           const at::Tensor& dw_EOI);
#define LF_EXPERT_LINEAR_BWD expert_linear_bwd_cpu
#define LF_EXPERT_GEMM_BACKEND expert_gemm_backend_cpu
#define LF_TOPK_COUNTS moe_topk_counts_cpu
#define LF_ROUTER_FWD moe_router_topk_fwd_cpu
#define LF_ROUTER_BWD moe_router_topk_bwd_cpu
#define LF_SCATTER_ROWS moe_scatter_rows_cpu
#define LF_GATHER_ROWS moe_gather_rows_cpu
#define LF_ROUTING_INDICES moe_routing_indices_cpu
#define LF_DEVICE "cpu"
constexpr c10::DeviceType kDispatchDevice = c10::DeviceType::CPU;
#endif

namespace {

at::Tensor permute_fwd(const at::Tensor& x_TH, const at::Tensor& slot_TK) {
    check_permute_fwd_args(x_TH, slot_TK, kDispatchDevice);
    auto x_PH = at::empty({slot_TK.numel(), x_TH.size(1)}, x_TH.options());
    LF_SCATTER_ROWS(x_TH, slot_TK, at::Tensor(), x_PH, at::Tensor(), at::Tensor());
    return x_PH;
}

at::Tensor permute_bwd(const at::Tensor& dx_PH, const at::Tensor& slot_TK) {
    check_permute_bwd_args(dx_PH, slot_TK, kDispatchDevice);
    auto dx_TH = at::empty({slot_TK.size(0), dx_PH.size(1)}, dx_PH.options());
    LF_GATHER_ROWS(dx_PH, slot_TK, at::Tensor(), at::Tensor(), dx_TH, false, false);
    return dx_TH;
}

at::Tensor unpermute_fwd(const at::Tensor& y_PH, const at::Tensor& slot_TK, const at::Tensor& weights_TK,
                         const c10::optional<at::Tensor>& residual_TH, bool stock, bool round_products) {
    check_unpermute_fwd_args(y_PH, slot_TK, weights_TK, residual_TH, kDispatchDevice);
    auto out_TH = at::empty({slot_TK.size(0), y_PH.size(1)}, y_PH.options());
    const bool has_residual = residual_TH.has_value() && residual_TH->defined();
    LF_GATHER_ROWS(y_PH, slot_TK, weights_TK, has_residual ? *residual_TH : at::Tensor(), out_TH, stock,
                   round_products);
    return out_TH;
}

std::vector<at::Tensor> unpermute_bwd(const at::Tensor& dout_TH, const c10::optional<at::Tensor>& y_PH,
                                      const at::Tensor& slot_TK, const at::Tensor& weights_TK) {
    check_unpermute_bwd_args(dout_TH, y_PH, slot_TK, weights_TK, kDispatchDevice);
    const bool need_dweights = y_PH.has_value() && y_PH->defined();
    auto dy_PH = at::empty({slot_TK.numel(), dout_TH.size(1)}, dout_TH.options());
    auto dweights_TK = need_dweights ? at::empty(slot_TK.sizes(), weights_TK.options()) : at::Tensor();
    LF_SCATTER_ROWS(dout_TH, slot_TK, weights_TK, dy_PH, need_dweights ? *y_PH : at::Tensor(), dweights_TK);
    return {dy_PH, dweights_TK};
}

std::vector<at::Tensor> routing_indices(const at::Tensor& ids_TK, int64_t num_experts) {
    check_routing_args(ids_TK, num_experts, kDispatchDevice);
    const auto index = ids_TK.options().dtype(at::kLong);
    auto order_P = at::empty({ids_TK.numel()}, index);
    auto slot_TK = at::empty(ids_TK.sizes(), index);
    auto counts_E = at::empty({num_experts}, index);
    auto offsets_E = at::empty({num_experts}, ids_TK.options().dtype(at::kInt));
    LF_ROUTING_INDICES(ids_TK, num_experts, order_P, slot_TK, counts_E, offsets_E);
    return {order_P, slot_TK, counts_E, offsets_E};
}

at::Tensor topk_counts(const at::Tensor& values_RE, int64_t k, const c10::optional<at::Tensor>& weights_R) {
    check_topk_counts_args(values_RE, k, weights_R, kDispatchDevice);
    auto counts_E = at::zeros({values_RE.size(1)}, values_RE.options().dtype(at::kLong));
    const bool weighted = weights_R.has_value() && weights_R->defined();
    LF_TOPK_COUNTS(values_RE, k, weighted ? *weights_R : at::Tensor(), counts_E);
    return counts_E;
}

std::vector<at::Tensor> router_topk_fwd(const at::Tensor& logits_TE, int64_t k, bool renormalize) {
    check_router_logits(logits_TE, k, kDispatchDevice);
    const auto f32 = logits_TE.options().dtype(at::kFloat);
    auto probs_TE = at::empty(logits_TE.sizes(), f32);
    auto weights_TK = at::empty({logits_TE.size(0), k}, f32);
    auto ids_TK = at::empty({logits_TE.size(0), k}, logits_TE.options().dtype(at::kLong));
    LF_ROUTER_FWD(logits_TE, k, renormalize, probs_TE, weights_TK, ids_TK);
    return {probs_TE, weights_TK, ids_TK};
}

at::Tensor router_topk_bwd(const at::Tensor& dweights_TK, const c10::optional<at::Tensor>& dprobs_TE,
                           const at::Tensor& probs_TE, const at::Tensor& ids_TK, bool renormalize,
                           at::ScalarType logits_dtype) {
    check_router_bwd_args(dweights_TK, dprobs_TE, probs_TE, ids_TK, kDispatchDevice);
    check_kernel_dtype(logits_dtype, "moe_router_topk_bwd", "the logits' dtype");
    auto dlogits_TE = at::empty(probs_TE.sizes(), probs_TE.options().dtype(logits_dtype));
    LF_ROUTER_BWD(dweights_TK, dprobs_TE.has_value() ? *dprobs_TE : at::Tensor(), probs_TE, ids_TK, renormalize,
                  dlogits_TE);
    return dlogits_TE;
}

// The backward of y_PO = x_PI @ w_EOI[e]^T on each expert's rows (expert-major, group sizes on the host): one GEMM
// per expert and product, all issued by one call of the build's loop (moe_expert_gemm.cpp / moe_expert_gemm_cpu.cpp).
//   dx_PI[rows of e] = dy_PO[rows of e] @ w_EOI[e]        dw_EOI[e] = dy_PO[rows of e]^T @ x_PI[rows of e]
// dw comes in the weight's own layout, as torch's grouped GEMM writes it (a transposed gradient would cost the
// parameter a strided copy: 0.68 ms a weight in the e2e mixtral step at 08b2d14); an expert without rows gets zeros.
// row_bucket: how the CUDA build groups row counts for its algorithm choice (moe_expert_gemm.cpp's bucket(): 0 eight
// buckets an octave, N > 0 multiples of N, -1 exact counts, -2 blocks of 8); the CPU build's ATen products have no
// such choice.
std::vector<at::Tensor> expert_linear_bwd(const at::Tensor& dy_PO, const at::Tensor& x_PI, const at::Tensor& w_EOI,
                                          const std::vector<int64_t>& counts, bool need_dx, bool need_dw,
                                          int64_t row_bucket) {
    check_expert_linear_bwd_args(dy_PO, x_PI, w_EOI, counts, kDispatchDevice);
    LF_CHECK(row_bucket >= -2, "expert_linear_backward: row_bucket must be 0 (8 buckets an octave), a positive row "
             "step, -1 (exact row counts) or -2 (blocks of 8), got ", row_bucket);
    at::Tensor dx_PI = need_dx ? at::empty(x_PI.sizes(), x_PI.options()) : at::Tensor();
    at::Tensor dw_EOI = need_dw ? at::empty(w_EOI.sizes(), w_EOI.options()) : at::Tensor();
    LF_EXPERT_LINEAR_BWD(dy_PO, x_PI, w_EOI, counts, row_bucket, dx_PI, dw_EOI);
    return {dx_PI, dw_EOI};
}

}  // namespace
}  // namespace loongforge

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.attr("device") = LF_DEVICE;
    m.attr("expert_gemm_backend") = loongforge::LF_EXPERT_GEMM_BACKEND();
    m.def("permute_forward", &loongforge::permute_fwd, py::arg("x_TH"), py::arg("slot_TK"),
          "x_PH[slot_TK[t, j]] = x_TH[t]: token rows to expert-major pair rows [T*K, H]");
    m.def("permute_backward", &loongforge::permute_bwd, py::arg("dx_PH"), py::arg("slot_TK"),
          "dx_TH[t] = sum_j dx_PH[slot_TK[t, j]] (fp32 accumulation, one rounding)");
    m.def("unpermute_forward", &loongforge::unpermute_fwd, py::arg("y_PH"), py::arg("slot_TK"),
          py::arg("weights_TK"), py::arg("residual_TH") = py::none(), py::arg("stock") = true,
          py::arg("round_products") = false,
          "out_TH[t] = residual_TH[t] + sum_j weights_TK[t, j] * y_PH[slot_TK[t, j]] (fp32 products and sum; "
          "stock: the sum rounded, then the residual added and rounded again, and round_products: each product "
          "rounded to y's dtype first; otherwise one rounding of it all; residual None: the sum, rounded once)");
    m.def("unpermute_backward", &loongforge::unpermute_bwd, py::arg("dout_TH"), py::arg("y_PH"),
          py::arg("slot_TK"), py::arg("weights_TK"),
          "returns (dy_PH, dweights_TK[fp32] or None when y_PH is None)");
    m.def("router_topk_forward", &loongforge::router_topk_fwd, py::arg("logits_TE"), py::arg("k"),
          py::arg("renormalize"),
          "(probs_TE[fp32 softmax], weights_TK[fp32], ids_TK): the k best experts, renormalised if asked");
    m.def("router_topk_backward", &loongforge::router_topk_bwd, py::arg("dweights_TK"), py::arg("dprobs_TE"),
          py::arg("probs_TE"), py::arg("ids_TK"), py::arg("renormalize"), py::arg("logits_dtype"),
          "dlogits_TE (in logits_dtype) from the gradients of weights_TK and probs_TE (None: zero)");
    m.def("topk_counts", &loongforge::topk_counts, py::arg("values_RE"), py::arg("k"),
          py::arg("weights_R") = py::none(),
          "counts_E[int64]: per column, the weights_R[r % len] (1: None) of the rows r whose k largest values "
          "(torch.topk's set, ties to the lower column) include it");
    m.def("expert_linear_backward", &loongforge::expert_linear_bwd, py::arg("dy_PO"), py::arg("x_PI"),
          py::arg("w_EOI"), py::arg("counts"), py::arg("need_dx"), py::arg("need_dw"), py::arg("row_bucket") = -2,
          "(dx_PI or None, dw_EOI or None) of y = x_PI @ w_EOI[e]^T per expert's rows (group sizes counts, on the "
          "host); one GEMM per expert and product, zeros for experts without rows; row_bucket: the CUDA build's "
          "row-count grouping for its algorithm choice (0: 8 an octave, N > 0: multiples of N, -1: exact, "
          "-2: blocks of 8)");
#ifdef LF_WITH_CUDA
    m.def("expert_gemm_stats", &loongforge::expert_gemm_stats_cuda,
          "[cuBLASLt heuristic queries, their host ns] since the process started");
    m.def("expert_gemm_heuristic", &loongforge::expert_gemm_heuristic_cuda, py::arg("like"), py::arg("wgrad"),
          py::arg("m"), py::arg("fixed"), py::arg("rows"),
          "cuBLASLt's exact heuristic choice (configuration attributes; [] if none) for one per-expert product");
#endif
    m.def("routing_indices", &loongforge::routing_indices, py::arg("ids_TK"), py::arg("num_experts"),
          "(order_P, slot_TK, counts_E, offsets_E[int32 inclusive cumsum]): the stable sort of the pairs by expert");
}
