// Python binding of the fused RMSNorm op. The CUDA build (LF_WITH_CUDA) binds the CUDA kernels, the
// CPU build the CPU kernels, under the same names, so the Python op calls `forward`/`backward` alike.
// pybind11 with torch's Tensor/optional casters only: torch/extension.h (all of libtorch's C++ API)
// made this file the slowest unit of a cold build (26 s vs 10 s on 2 cores).
#include <torch/csrc/utils/pybind.h>

#include "lf_common.h"

namespace loongforge {
#ifdef LF_WITH_CUDA
std::vector<at::Tensor> rmsnorm_fwd_cuda(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                         const at::Tensor& weight, double eps, bool stock_rounding);
std::vector<at::Tensor> rmsnorm_bwd_cuda(const at::Tensor& dy, const at::Tensor& h,
                                         const at::Tensor& rstd, const at::Tensor& weight,
                                         const c10::optional<at::Tensor>& dresidual, bool stock_rounding);
#define LF_RMSNORM_FWD rmsnorm_fwd_cuda
#define LF_RMSNORM_BWD rmsnorm_bwd_cuda
#define LF_DEVICE "cuda"
#else
std::vector<at::Tensor> rmsnorm_fwd_cpu(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                        const at::Tensor& weight, double eps, bool stock_rounding);
std::vector<at::Tensor> rmsnorm_bwd_cpu(const at::Tensor& dy, const at::Tensor& h,
                                        const at::Tensor& rstd, const at::Tensor& weight,
                                        const c10::optional<at::Tensor>& dresidual, bool stock_rounding);
#define LF_RMSNORM_FWD rmsnorm_fwd_cpu
#define LF_RMSNORM_BWD rmsnorm_bwd_cpu
#define LF_DEVICE "cpu"
#endif
}  // namespace loongforge

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.attr("device") = LF_DEVICE;
    m.def("forward", &loongforge::LF_RMSNORM_FWD, py::arg("x"), py::arg("residual"), py::arg("weight"),
          py::arg("eps"), py::arg("stock_rounding"),
          "RMSNorm forward on rows [rows, hidden]; returns (y, new_residual or None, rstd[fp32]); "
          "stock_rounding: round h * rstd before the weight, as transformers does");
    m.def("backward", &loongforge::LF_RMSNORM_BWD, py::arg("dy"), py::arg("h"), py::arg("rstd"),
          py::arg("weight"), py::arg("dresidual"), py::arg("stock_rounding"),
          "RMSNorm backward; returns (dx, dweight)");
}
