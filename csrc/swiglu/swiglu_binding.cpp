// Python binding of the fused SwiGLU + dropout op; CUDA or CPU kernels under the same names.
// pybind11 with torch's Tensor/optional casters only: torch/extension.h (all of libtorch's C++ API)
// made this file the slowest unit of a cold build (26 s vs 10 s on 2 cores).
#include <torch/csrc/utils/pybind.h>

#include "lf_common.h"

namespace loongforge {
#ifdef LF_WITH_CUDA
at::Tensor swiglu_fwd_cuda(const at::Tensor& gate_up, double p, int64_t seed, int64_t offset,
                           bool stock_rounding);
at::Tensor swiglu_bwd_cuda(const at::Tensor& dout, const at::Tensor& gate_up, double p, int64_t seed,
                           int64_t offset, bool stock_rounding);
#define LF_SWIGLU_FWD swiglu_fwd_cuda
#define LF_SWIGLU_BWD swiglu_bwd_cuda
#define LF_DEVICE "cuda"
#else
at::Tensor swiglu_fwd_cpu(const at::Tensor& gate_up, double p, int64_t seed, int64_t offset,
                          bool stock_rounding);
at::Tensor swiglu_bwd_cpu(const at::Tensor& dout, const at::Tensor& gate_up, double p, int64_t seed,
                          int64_t offset, bool stock_rounding);
#define LF_SWIGLU_FWD swiglu_fwd_cpu
#define LF_SWIGLU_BWD swiglu_bwd_cpu
#define LF_DEVICE "cpu"
#endif
}  // namespace loongforge

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.attr("device") = LF_DEVICE;
    m.def("forward", &loongforge::LF_SWIGLU_FWD, py::arg("gate_up"), py::arg("p"), py::arg("seed"),
          py::arg("offset"), py::arg("stock_rounding"),
          "silu(gate) * up, then dropout(p) from Philox(seed, offset); [rows, 2I] -> [rows, I]. stock_rounding: "
          "round 16-bit intermediates where eager PyTorch does (else fp32 to the end, one rounding)");
    m.def("backward", &loongforge::LF_SWIGLU_BWD, py::arg("dout"), py::arg("gate_up"), py::arg("p"),
          py::arg("seed"), py::arg("offset"), py::arg("stock_rounding"),
          "gradient with respect to gate_up, mask regenerated; stock_rounding as in forward");
}
