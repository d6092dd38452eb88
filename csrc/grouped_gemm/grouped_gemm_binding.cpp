// Python binding of the grouped GEMM (CUDA only: the CPU path is one torch GEMM per group, in Python).
#include <torch/csrc/utils/pybind.h>

#include "lf_common.h"

namespace loongforge {
namespace grouped_gemm {
at::Tensor grouped_rows(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs, bool w_nk,
                        int64_t config);
at::Tensor grouped_wgrad(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs, int64_t config);
}  // namespace grouped_gemm
}  // namespace loongforge

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.attr("device") = "cuda";
    m.attr("configs") = 3;
    m.def("rows", &loongforge::grouped_gemm::grouped_rows, py::arg("x"), py::arg("w"), py::arg("offs"),
          py::arg("w_nk"), py::arg("config"),
          "x [P, K], rows grouped by the int32 group ends offs [G], times w[g]: w [G, N, K] with w_nk "
          "(x w[g]^T) or [G, K, N] -> [P, N] bf16, fp32 accumulation");
    m.def("wgrad", &loongforge::grouped_gemm::grouped_wgrad, py::arg("a"), py::arg("b"), py::arg("offs"),
          py::arg("config"),
          "a [P, M], b [P, N], rows grouped by offs [G] -> [G, M, N], out[g] = a[rows g]^T b[rows g] "
          "(zeros for a group with no rows)");
}
