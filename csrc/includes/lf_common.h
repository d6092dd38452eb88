// Shared helpers for ds_loongforge kernels: input checks that name what arrived, dtype dispatch,
// and a counter-based Philox4x32-10 generator usable on host and device so the CPU kernel, the CUDA
// kernel and the PyTorch reference draw the very same dropout mask for a given (seed, offset).
#pragma once

// Only the ATen pieces the kernels use: torch/extension.h (pybind11 and all of torch) is left to the
// binding file, which keeps nvcc's share of a build short.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <type_traits>
#include <cstdio>
#include <sstream>
#include <string>
#include <type_traits>

// LF_CHECK(cond, pieces...): TORCH_CHECK with the message assembled here, numbers by std::to_string.
// On the device image (torch 2.11 wheel with the system libstdc++) an extension that streams an integer
// or a shape into a TORCH_CHECK message segfaults instead of raising, while streamed strings, dtypes and
// devices are fine (benchmarks/results/check_msg_8e950be.log). So every number goes through a string.
namespace loongforge {
namespace detail {
inline void lf_append(std::string& s, const char* v) { s += v; }
inline void lf_append(std::string& s, const std::string& v) { s += v; }
inline void lf_append(std::string& s, bool v) { s += v ? "true" : "false"; }
template <typename T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool>, int> = 0>
inline void lf_append(std::string& s, T v) {
    s += std::to_string(v);
}
template <typename T, std::enable_if_t<std::is_floating_point_v<T>, int> = 0>
inline void lf_append(std::string& s, T v) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%g", static_cast<double>(v));
    s += buf;
}
inline void lf_append(std::string& s, c10::IntArrayRef v) {
    s += '[';
    for (size_t i = 0; i < v.size(); ++i) {
        if (i) s += ", ";
        s += std::to_string(v[i]);
    }
    s += ']';
}
inline void lf_append(std::string& s, c10::ScalarType v) { s += c10::toString(v); }
inline void lf_append(std::string& s, const c10::Device& v) { s += v.str(); }
inline void lf_append(std::string& s, c10::DeviceType v) { s += c10::DeviceTypeName(v, /*lower_case=*/true); }
template <typename... Args>
std::string lf_msg(const Args&... args) {
    std::string s;
    (lf_append(s, args), ...);
    return s;
}
}  // namespace detail
}  // namespace loongforge

#define LF_CHECK(cond, ...) TORCH_CHECK(cond, ::loongforge::detail::lf_msg(__VA_ARGS__))

#if defined(__CUDACC__)
#define LF_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define LF_HOST_DEVICE inline
#endif

#define LF_CHECK_CUDA(x) \
    LF_CHECK((x).is_cuda(), #x " must be a CUDA tensor, got a tensor on ", (x).device())
#define LF_CHECK_CPU(x) \
    LF_CHECK((x).device().is_cpu(), #x " must be a CPU tensor, got a tensor on ", (x).device())
#define LF_CHECK_CONTIGUOUS(x) \
    LF_CHECK((x).is_contiguous(), #x " must be contiguous, got strides ", (x).strides())
#define LF_CHECK_DIM(x, d) \
    LF_CHECK((x).dim() == (d), #x " must have ", d, " dimensions, got shape ", (x).sizes())
#define LF_CHECK_SHAPE(x, ...)                                                                   \
    LF_CHECK((x).sizes() == at::IntArrayRef({__VA_ARGS__}), #x " must have shape (" #__VA_ARGS__ \
                "), got ", (x).sizes())
#define LF_CHECK_DTYPE(x, dt) \
    LF_CHECK((x).scalar_type() == (dt), #x " must have dtype ", dt, ", got ", (x).scalar_type())
#define LF_CHECK_FLOATING(x)                                                                       \
    LF_CHECK((x).scalar_type() == at::kFloat || (x).scalar_type() == at::kHalf ||               \
                    (x).scalar_type() == at::kBFloat16,                                            \
                #x " must be float32, float16 or bfloat16, got ", (x).scalar_type())
// A 2-D view whose rows may be strided but whose elements within a row are adjacent.
#define LF_CHECK_ROWS(x)                                                                       \
    LF_CHECK((x).dim() == 2 && ((x).size(1) <= 1 || (x).stride(1) == 1),                    \
                #x " must be a 2-D view with unit stride along the last dimension, got shape ", \
                (x).sizes(), " and strides ", (x).strides())

// Dispatch over the activation dtype (float, half, bfloat16) with `scalar_t` bound inside.
#define LF_DISPATCH_FLOATING(TYPE, NAME, ...)                                          \
    [&] {                                                                              \
        switch (TYPE) {                                                                \
            case at::kFloat: {                                                         \
                using scalar_t = float;                                                \
                return __VA_ARGS__();                                                  \
            }                                                                          \
            case at::kHalf: {                                                          \
                using scalar_t = at::Half;                                             \
                return __VA_ARGS__();                                                  \
            }                                                                          \
            case at::kBFloat16: {                                                      \
                using scalar_t = at::BFloat16;                                         \
                return __VA_ARGS__();                                                  \
            }                                                                          \
            default:                                                                   \
                LF_CHECK(false, NAME, ": unsupported dtype ", TYPE,                 \
                            " (supported: float32, float16, bfloat16)");               \
        }                                                                              \
    }()

namespace loongforge {

// v stored in T and read back: where an unfused PyTorch op would store an intermediate in the activation dtype
// (the "stock" rounding of the fused ops). The identity for float.
template <typename T>
LF_HOST_DEVICE float lf_round_to(float v) {
    if constexpr (std::is_same_v<T, float>) {
        return v;
    } else {
        return static_cast<float>(static_cast<T>(v));
    }
}

// Philox4x32-10 (Salmon et al., SC'11), the generator cuRAND and PyTorch use. Counter-based: the
// random word for a given (key, counter) needs no state, so backward regenerates forward's mask.
struct Philox4 {
    uint32_t v[4];
};

LF_HOST_DEVICE uint32_t lf_mulhilo(uint32_t a, uint32_t b, uint32_t* hi) {
    const uint64_t product = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
    *hi = static_cast<uint32_t>(product >> 32);
    return static_cast<uint32_t>(product);
}

LF_HOST_DEVICE Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                                     uint32_t k1) {
    constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
    constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
#if defined(__CUDACC__)
#pragma unroll
#endif
    for (int round = 0; round < 10; ++round) {
        uint32_t hi0, hi1;
        const uint32_t lo0 = lf_mulhilo(kM0, c0, &hi0);
        const uint32_t lo1 = lf_mulhilo(kM1, c2, &hi1);
        const uint32_t n0 = hi1 ^ c1 ^ k0;
        const uint32_t n2 = hi0 ^ c3 ^ k1;
        c0 = n0;
        c1 = lo1;
        c2 = n2;
        c3 = lo0;
        k0 += kW0;
        k1 += kW1;
    }
    return Philox4{{c0, c1, c2, c3}};
}

// Words for flat elements [4*block, 4*block+4): counter = (block, offset), key = seed.
LF_HOST_DEVICE Philox4 dropout_words(uint64_t seed, uint64_t offset, uint64_t block) {
    return philox4x32_10(static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32),
                         static_cast<uint32_t>(offset), static_cast<uint32_t>(offset >> 32),
                         static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

// An element is kept when its 32-bit word is below keep_threshold = floor((1 - p) * 2^32); comparing
// integers (not floats) makes every implementation agree bit for bit.
inline uint32_t keep_threshold_from_p(double p) {
    const double t = (1.0 - p) * 4294967296.0;
    return t >= 4294967295.0 ? 0xFFFFFFFFu : static_cast<uint32_t>(t);
}

}  // namespace loongforge
