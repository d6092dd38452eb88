// Python binding of the fused AdamW + global-norm clip op. The table builder and every argument check live
// here, once for both builds; each build supplies the three launchers (adamw.cu on CUDA, adamw_cpu.cpp on
// the CPU):
//   sumsq_partials: pass 1 over one bucket -> per-partial sum of squares and non-finite flags
//   reduce_partials: partials of every bucket -> stats[2], in a fixed order
//   adamw_update: pass 2 over one bucket, then the step counts, unless stats[1] != 0
// pybind11 with torch's Tensor/optional casters only: torch/extension.h (all of libtorch's C++ API)
// made a binding the slowest unit of a cold build.
#include <torch/csrc/utils/pybind.h>

#include <vector>

#include "adamw_common.h"

namespace loongforge {
namespace adamw {
#ifdef LF_WITH_CUDA
void sumsq_partials_cuda(const TableHeader& h, const at::Tensor& dev_table, const at::Tensor& partials,
                         const at::Tensor& flags);
void reduce_partials_cuda(const at::Tensor& partials, const at::Tensor& flags, const at::Tensor& stats);
void adamw_update_cuda(const TableHeader& h, const at::Tensor& dev_table, const at::Tensor& stats,
                       const float* inv_scale_dev, const Hyper& hp);
#define LF_SUMSQ_PARTIALS sumsq_partials_cuda
#define LF_REDUCE_PARTIALS reduce_partials_cuda
#define LF_ADAMW_UPDATE adamw_update_cuda
#define LF_DEVICE "cuda"
constexpr c10::DeviceType kDevice = c10::DeviceType::CUDA;
#else
void sumsq_partials_cpu(const TableHeader& h, const at::Tensor& dev_table, const at::Tensor& partials,
                        const at::Tensor& flags);
void reduce_partials_cpu(const at::Tensor& partials, const at::Tensor& flags, const at::Tensor& stats);
void adamw_update_cpu(const TableHeader& h, const at::Tensor& dev_table, const at::Tensor& stats,
                      const float* inv_scale_dev, const Hyper& hp);
#define LF_SUMSQ_PARTIALS sumsq_partials_cpu
#define LF_REDUCE_PARTIALS reduce_partials_cpu
#define LF_ADAMW_UPDATE adamw_update_cpu
#define LF_DEVICE "cpu"
constexpr c10::DeviceType kDevice = c10::DeviceType::CPU;
#endif

namespace {

int64_t dtype_code(const at::Tensor& t, const char* what) {
    switch (t.scalar_type()) {
        case at::kFloat: return kF32;
        case at::kBFloat16: return kBF16;
        case at::kHalf: return kF16;
        default:
            LF_CHECK(false, "fused_adamw_clip: ", what, " must be float32, bfloat16 or float16, got ",
                        t.scalar_type());
    }
}

void check_member(const at::Tensor& t, const at::Tensor& param, size_t i, const char* what, bool fp32) {
    LF_CHECK(t.device() == param.device(), "fused_adamw_clip: ", what, "[", i, "] is on ", t.device(),
                " but params[", i, "] on ", param.device());
    LF_CHECK(t.is_contiguous(), "fused_adamw_clip: ", what, "[", i, "] must be contiguous, got strides ",
                t.strides());
    LF_CHECK(t.numel() == param.numel(), "fused_adamw_clip: ", what, "[", i, "] has ", t.numel(),
                " elements but params[", i, "] has ", param.numel());
    if (fp32) {
        LF_CHECK(t.scalar_type() == at::kFloat, "fused_adamw_clip: ", what, "[", i,
                    "] must be float32, got ", t.scalar_type());
    }
}

bool aligned16(const at::Tensor& t) { return t.numel() == 0 || (reinterpret_cast<uintptr_t>(t.data_ptr()) & 15u) == 0; }

// The table of one bucket (see adamw_common.h). `masters` is empty (params updated in place, in their own
// dtype) or holds one float32 master copy per param (low-precision params are then written back from it).
at::Tensor make_table(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& masters,
                      const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& exp_avgs,
                      const std::vector<at::Tensor>& exp_avg_sqs, const std::vector<at::Tensor>& steps) {
    const size_t n = params.size();
    LF_CHECK(n > 0, "fused_adamw_clip: a bucket needs at least one tensor");
    LF_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && steps.size() == n &&
                    (masters.empty() || masters.size() == n),
                "fused_adamw_clip: every list must have one entry per param (", n, "), got grads ", grads.size(),
                ", exp_avgs ", exp_avgs.size(), ", exp_avg_sqs ", exp_avg_sqs.size(), ", steps ", steps.size(),
                ", masters ", masters.size(), " (0 = no master weights)");
    const int64_t param_dtype = dtype_code(params[0], "params[0]");
    const int64_t grad_dtype = dtype_code(grads[0], "grads[0]");
    LF_CHECK(grad_dtype == kF32 || grad_dtype == param_dtype, "fused_adamw_clip: grads must be float32 or ",
                "the params' dtype ", params[0].scalar_type(), ", got ", grads[0].scalar_type());
    LF_CHECK(masters.empty() || param_dtype != kF32,
                "fused_adamw_clip: float32 params take no master weights (pass masters=[])");
    int64_t n_chunks = 0;
    for (size_t i = 0; i < n; ++i) {
        const at::Tensor& p = params[i];
        LF_CHECK(p.device().type() == kDevice, "fused_adamw_clip: params[", i, "] must be on ", kDevice,
                    " for this build, got a tensor on ", p.device());
        LF_CHECK(p.device() == params[0].device(), "fused_adamw_clip: params[", i, "] is on ", p.device(),
                    " but params[0] on ", params[0].device());
        LF_CHECK(p.is_contiguous(), "fused_adamw_clip: params[", i, "] must be contiguous, got strides ",
                    p.strides());
        LF_CHECK(dtype_code(p, "params") == param_dtype, "fused_adamw_clip: params[", i, "] is ",
                    p.scalar_type(), " but params[0] is ", params[0].scalar_type(), " (one dtype per bucket)");
        LF_CHECK(dtype_code(grads[i], "grads") == grad_dtype, "fused_adamw_clip: grads[", i, "] is ",
                    grads[i].scalar_type(), " but grads[0] is ", grads[0].scalar_type(), " (one dtype per bucket)");
        check_member(grads[i], p, i, "grads", false);
        check_member(exp_avgs[i], p, i, "exp_avgs", true);
        check_member(exp_avg_sqs[i], p, i, "exp_avg_sqs", true);
        if (!masters.empty()) check_member(masters[i], p, i, "masters", true);
        LF_CHECK(steps[i].device() == p.device() && steps[i].scalar_type() == at::kFloat && steps[i].numel() == 1,
                    "fused_adamw_clip: steps[", i, "] must be a one-element float32 tensor on ", p.device(),
                    ", got ", steps[i].scalar_type(), " of shape ", steps[i].sizes(), " on ", steps[i].device());
        n_chunks += (p.numel() + kChunkSize - 1) / kChunkSize;
    }
    LF_CHECK(static_cast<int64_t>(n) < (int64_t{1} << 31), "fused_adamw_clip: too many tensors in one bucket: ", n);
    auto table = at::empty({kHeader + static_cast<int64_t>(n) * kEntry + n_chunks}, at::dtype(at::kLong));
    int64_t* t = table.data_ptr<int64_t>();
    const int64_t header[kHeader] = {static_cast<int64_t>(n), n_chunks, param_dtype, grad_dtype,
                                     masters.empty() ? 0 : 1, kChunkSize, 0, 0};
    for (int k = 0; k < kHeader; ++k) t[k] = header[k];
    int64_t* entries = t + kHeader;
    int64_t* chunks = entries + static_cast<int64_t>(n) * kEntry;
    auto addr = [](const at::Tensor& x) { return static_cast<int64_t>(reinterpret_cast<uintptr_t>(x.data_ptr())); };
    for (size_t i = 0; i < n; ++i) {
        int64_t* e = entries + i * kEntry;
        const bool has_master = !masters.empty();
        e[kParam] = addr(params[i]);
        e[kMaster] = has_master ? addr(masters[i]) : 0;
        e[kGrad] = addr(grads[i]);
        e[kExpAvg] = addr(exp_avgs[i]);
        e[kExpAvgSq] = addr(exp_avg_sqs[i]);
        e[kStep] = addr(steps[i]);
        e[kNumel] = params[i].numel();
        e[kVecOk] = aligned16(params[i]) && aligned16(grads[i]) && aligned16(exp_avgs[i]) &&
                    aligned16(exp_avg_sqs[i]) && (!has_master || aligned16(masters[i]));
        const int64_t c = (params[i].numel() + kChunkSize - 1) / kChunkSize;
        for (int64_t k = 0; k < c; ++k) *chunks++ = (static_cast<int64_t>(i) << 32) | k;
    }
    return table;
}

void check_tables(const at::Tensor& cpu_table, const at::Tensor& dev_table) {
    LF_CHECK(dev_table.device().type() == kDevice && dev_table.scalar_type() == at::kLong &&
                    dev_table.sizes() == cpu_table.sizes(),
                "fused_adamw_clip: dev_table must be the table copied to the ", kDevice, " device, got ",
                dev_table.scalar_type(), " of shape ", dev_table.sizes(), " on ", dev_table.device());
}

void check_stats(const at::Tensor& stats, const at::Tensor& dev_table) {
    LF_CHECK(stats.device() == dev_table.device() && stats.scalar_type() == at::kFloat && stats.numel() == 2 &&
                    stats.is_contiguous(),
                "fused_adamw_clip: stats must be a contiguous float32 tensor of 2 elements on ", dev_table.device(),
                ", got ", stats.scalar_type(), " of shape ", stats.sizes(), " on ", stats.device());
}

// Pass 1 over every bucket: stats = [sum of squares, non-finite count], reduced in a fixed order.
void grad_stats(const std::vector<at::Tensor>& cpu_tables, const std::vector<at::Tensor>& dev_tables,
                const at::Tensor& stats) {
    LF_CHECK(!cpu_tables.empty() && cpu_tables.size() == dev_tables.size(),
                "fused_adamw_clip.grad_stats: needs one device table per CPU table and at least one, got ",
                cpu_tables.size(), " and ", dev_tables.size());
    std::vector<TableHeader> headers;
    int64_t total = 0;
    for (size_t b = 0; b < cpu_tables.size(); ++b) {
        headers.push_back(read_header(cpu_tables[b]));
        check_tables(cpu_tables[b], dev_tables[b]);
        check_stats(stats, dev_tables[b]);
        total += num_partials(headers.back());
    }
    auto partials = at::empty({total > 0 ? total : 1}, stats.options());
    auto flags = at::empty({total > 0 ? total : 1}, stats.options());
    int64_t offset = 0;
    for (size_t b = 0; b < cpu_tables.size(); ++b) {
        const int64_t p = num_partials(headers[b]);
        if (p == 0) continue;
        LF_SUMSQ_PARTIALS(headers[b], dev_tables[b], partials.narrow(0, offset, p), flags.narrow(0, offset, p));
        offset += p;
    }
    LF_REDUCE_PARTIALS(partials.narrow(0, 0, offset), flags.narrow(0, 0, offset), stats);
}

// Pass 2 over one bucket with its group's hyper-parameters.
void adamw_apply(const at::Tensor& cpu_table, const at::Tensor& dev_table, const at::Tensor& stats, double lr,
                 double beta1, double beta2, double eps, double weight_decay, double max_norm, double clip_eps,
                 double inv_scale, const c10::optional<at::Tensor>& inv_scale_t) {
    const TableHeader h = read_header(cpu_table);
    check_tables(cpu_table, dev_table);
    check_stats(stats, dev_table);
    LF_CHECK(lr >= 0.0, "fused_adamw_clip: lr must be >= 0, got ", lr);
    LF_CHECK(beta1 >= 0.0 && beta1 < 1.0 && beta2 >= 0.0 && beta2 < 1.0,
                "fused_adamw_clip: betas must be in [0, 1), got (", beta1, ", ", beta2, ")");
    LF_CHECK(eps > 0.0, "fused_adamw_clip: eps must be > 0, got ", eps);
    LF_CHECK(inv_scale > 0.0, "fused_adamw_clip: inv_scale must be > 0, got ", inv_scale);
    const float* inv_scale_dev = nullptr;
    if (inv_scale_t.has_value()) {  // a dynamic loss scale kept on the device: its inverse, read by the kernel
        const at::Tensor& t = *inv_scale_t;
        LF_CHECK(t.device() == stats.device() && t.scalar_type() == at::kFloat && t.numel() == 1,
                 "fused_adamw_clip: inv_scale_t must be one float32 element on the stats' device");
        inv_scale_dev = t.data_ptr<float>();
    }
    if (h.n_tensors == 0) return;
    // a bucket of zero-size tensors only (n_chunks == 0) still advances their step counts, as torch's AdamW does
    LF_ADAMW_UPDATE(h, dev_table, stats, inv_scale_dev,
                    Hyper{lr, beta1, beta2, eps, weight_decay, max_norm, clip_eps, inv_scale});
}

}  // namespace
}  // namespace adamw
}  // namespace loongforge

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    using namespace loongforge::adamw;
    m.attr("device") = LF_DEVICE;
    m.attr("chunk_size") = kChunkSize;
    m.def("make_table", &make_table, py::arg("params"), py::arg("masters"), py::arg("grads"), py::arg("exp_avgs"),
          py::arg("exp_avg_sqs"), py::arg("steps"),
          "CPU int64 table of one same-layout bucket (copy it to the device once and keep both)");
    m.def("grad_stats", &grad_stats, py::arg("cpu_tables"), py::arg("dev_tables"), py::arg("stats"),
          "pass 1: stats[0] = sum of squared grads, stats[1] = non-finite count, over every bucket");
    m.def("adamw_apply", &adamw_apply, py::arg("cpu_table"), py::arg("dev_table"), py::arg("stats"), py::arg("lr"),
          py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("max_norm"),
          py::arg("clip_eps"), py::arg("inv_scale"), py::arg("inv_scale_t") = py::none(),
          "pass 2: clipped AdamW on one bucket and its step counts, or nothing when stats[1] != 0");
}
