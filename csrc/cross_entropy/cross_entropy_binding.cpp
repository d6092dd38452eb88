// Python binding of the fused softmax cross-entropy op; CUDA or CPU kernel under the same name.
// pybind11 with torch's Tensor/optional casters only (see swiglu_binding.cpp for why not torch/extension.h).
#include <torch/csrc/utils/pybind.h>

#include "cross_entropy_checks.h"

namespace loongforge {
#ifdef LF_WITH_CUDA
at::Tensor cross_entropy_cuda(const at::Tensor& logits, const at::Tensor& target, const at::Tensor& valid,
                              const at::Tensor& scale, const c10::optional<at::Tensor>& grad);
void scale_by_cuda(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& out);
#define LF_CROSS_ENTROPY cross_entropy_cuda
#define LF_SCALE_BY scale_by_cuda
#define LF_DEVICE "cuda"
#else
at::Tensor cross_entropy_cpu(const at::Tensor& logits, const at::Tensor& target, const at::Tensor& valid,
                             const at::Tensor& scale, const c10::optional<at::Tensor>& grad);
void scale_by_cpu(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& out);
#define LF_CROSS_ENTROPY cross_entropy_cpu
#define LF_SCALE_BY scale_by_cpu
#define LF_DEVICE "cpu"
#endif

namespace {
at::Tensor scale_by(const at::Tensor& x, const at::Tensor& scale, const c10::optional<at::Tensor>& out) {
#ifdef LF_WITH_CUDA
    constexpr c10::DeviceType device = c10::DeviceType::CUDA;
#else
    constexpr c10::DeviceType device = c10::DeviceType::CPU;
#endif
    const at::Tensor dst = out.has_value() && out->defined() ? *out : at::empty_like(x);
    check_scale_by_args(x, scale, dst, device);
    LF_SCALE_BY(x, scale, dst);
    return dst;
}
}  // namespace
}  // namespace loongforge

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.attr("device") = LF_DEVICE;
    m.def("forward", &loongforge::LF_CROSS_ENTROPY, py::arg("logits"), py::arg("target"), py::arg("valid"),
          py::arg("scale"), py::arg("grad"),
          "per row of logits [C, V] (fp32/bf16/fp16; fp32 math): fp32 nll[C] (0 on rows not valid); with grad "
          "[C, V] given, writes (softmax - onehot(target)) * scale into it");
    m.def("scale_by", &loongforge::scale_by, py::arg("x"), py::arg("scale"), py::arg("out") = py::none(),
          "out = x * scale[0] (a float32 device scalar) in fp32, rounded once to x's dtype; out may be x "
          "(None: a new tensor)");
}
