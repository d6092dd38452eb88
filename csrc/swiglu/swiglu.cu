// Fused SwiGLU + dropout on the concatenated gate/up projection, on CUDA.
//
//   gate_up[n, :] = [gate (I) | up (I)]          (one GEMM with weight [2I, H] produced it)
//   out[n, i]     = silu(gate) * up * keep(e) / (1 - p),   e = n * I + i
//   keep(e)       = Philox4x32-10(counter = (e / 4, offset), key = seed)[e % 4] < (1 - p) * 2^32
//   backward:     dz = dout * keep / (1 - p);  s = sigmoid(gate)
//                 dgate = dz * up * s * (1 + gate * (1 - s)),  dup = dz * gate * s
//
// The mask is never stored: backward regenerates it from (seed, offset). With p == 0 the kernels are
// instantiated without any RNG. Arithmetic is fp32 with one rounding per output.
// Preconditions of the vector path: I % V == 0 and 16-byte-aligned rows (V = 16 / sizeof(T)); each
// thread then handles V adjacent outputs of one row, i.e. V/4 whole Philox blocks. Otherwise a
// scalar path handles any I.
#include "lf_cuda_utils.cuh"

namespace loongforge {
namespace {

constexpr int kThreads = 256;

struct DropoutArgs {
    uint64_t seed;
    uint64_t offset;
    uint32_t keep_threshold;
    float scale;
};

// keep bits for V adjacent flat elements starting at e0 (e0 % 4 == 0 when V >= 4).
template <int V>
__device__ __forceinline__ void keep_bits(const DropoutArgs& d, uint64_t e0, bool (&keep)[V]) {
    if constexpr (V >= 4) {
#pragma unroll
        for (int b = 0; b < V / 4; ++b) {
            const Philox4 r = dropout_words(d.seed, d.offset, e0 / 4 + b);
#pragma unroll
            for (int j = 0; j < 4; ++j) keep[b * 4 + j] = r.v[j] < d.keep_threshold;
        }
    } else {
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const uint64_t e = e0 + j;
            const Philox4 r = dropout_words(d.seed, d.offset, e / 4);
            keep[j] = r.v[e % 4] < d.keep_threshold;
        }
    }
}

__device__ __forceinline__ float sigmoidf_fast(float x) { return 1.f / (1.f + __expf(-x)); }

template <typename T, int V, bool DROPOUT>
__global__ void __launch_bounds__(kThreads)
    swiglu_fwd_kernel(const T* __restrict__ gate_up, int64_t in_stride, T* __restrict__ out,
                      int64_t rows, int64_t inter, DropoutArgs d) {
    const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (c >= inter / V) return;
    const int64_t i0 = c * V;
    for (int64_t n = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; n < rows;
         n += static_cast<int64_t>(gridDim.y) * blockDim.y) {
        const T* row = gate_up + n * in_stride;
        const Vec<T, V> gv = load_vec<T, V>(row + i0);
        const Vec<T, V> uv = load_vec<T, V>(row + inter + i0);
        bool keep[V];
        if constexpr (DROPOUT) keep_bits<V>(d, static_cast<uint64_t>(n * inter + i0), keep);
        Vec<T, V> ov;
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const float g = static_cast<float>(gv.val[j]);
            float o = g * sigmoidf_fast(g) * static_cast<float>(uv.val[j]);
            if constexpr (DROPOUT) o = keep[j] ? o * d.scale : 0.f;
            ov.val[j] = static_cast<T>(o);
        }
        store_vec<T, V>(out + n * inter + i0, ov);
    }
}

template <typename T, int V, bool DROPOUT>
__global__ void __launch_bounds__(kThreads)
    swiglu_bwd_kernel(const T* __restrict__ dout, const T* __restrict__ gate_up, int64_t in_stride,
                      T* __restrict__ dgate_up, int64_t rows, int64_t inter, DropoutArgs d) {
    const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (c >= inter / V) return;
    const int64_t i0 = c * V;
    for (int64_t n = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; n < rows;
         n += static_cast<int64_t>(gridDim.y) * blockDim.y) {
        const T* row = gate_up + n * in_stride;
        const Vec<T, V> gv = load_vec<T, V>(row + i0);
        const Vec<T, V> uv = load_vec<T, V>(row + inter + i0);
        const Vec<T, V> dv = load_vec<T, V>(dout + n * inter + i0);
        bool keep[V];
        if constexpr (DROPOUT) keep_bits<V>(d, static_cast<uint64_t>(n * inter + i0), keep);
        Vec<T, V> dgv, duv;
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const float g = static_cast<float>(gv.val[j]);
            const float u = static_cast<float>(uv.val[j]);
            float dz = static_cast<float>(dv.val[j]);
            if constexpr (DROPOUT) dz = keep[j] ? dz * d.scale : 0.f;
            const float s = sigmoidf_fast(g);
            dgv.val[j] = static_cast<T>(dz * u * s * (1.f + g * (1.f - s)));
            duv.val[j] = static_cast<T>(dz * g * s);
        }
        T* drow = dgate_up + n * 2 * inter;
        store_vec<T, V>(drow + i0, dgv);
        store_vec<T, V>(drow + inter + i0, duv);
    }
}

DropoutArgs make_dropout_args(double p, int64_t seed, int64_t offset) {
    TORCH_CHECK(p >= 0.0 && p < 1.0, "swiglu_dropout: p must be in [0, 1), got ", p);
    return DropoutArgs{static_cast<uint64_t>(seed), static_cast<uint64_t>(offset),
                       keep_threshold_from_p(p), static_cast<float>(1.0 / (1.0 - p))};
}

// Grid over (vector within a row, row): x covers a row's vectors, y its rows. No grid-stride loop over
// a flat index: measured on an H200, the flat version's per-element 64-bit divide and loop held the
// backward at 44% of copy bandwidth, this layout at ~100%. Narrow rows share a block (blockDim.y > 1).
struct Launch {
    dim3 grid, block;
};

Launch launch_for(int64_t rows, int64_t vecs_per_row) {
    int tx = 1;
    while (tx < vecs_per_row && tx < kThreads) tx <<= 1;
    const int ty = kThreads / tx;
    const int64_t gy = std::min<int64_t>((rows + ty - 1) / ty, 65535);
    return {dim3(static_cast<unsigned>((vecs_per_row + tx - 1) / tx), static_cast<unsigned>(gy)), dim3(tx, ty)};
}

}  // namespace

at::Tensor swiglu_fwd_cuda(const at::Tensor& gate_up, double p, int64_t seed, int64_t offset) {
    LF_CHECK_CUDA(gate_up);
    LF_CHECK_ROWS(gate_up);
    LF_CHECK_FLOATING(gate_up);
    TORCH_CHECK(gate_up.size(1) % 2 == 0, "swiglu: the last dimension holds [gate | up] and must be "
                "even, got ", gate_up.size(1));
    const DropoutArgs d = make_dropout_args(p, seed, offset);
    const c10::cuda::CUDAGuard guard(gate_up.device());
    const int64_t rows = gate_up.size(0);
    const int64_t inter = gate_up.size(1) / 2;
    auto out = at::empty({rows, inter}, gate_up.options());
    if (rows == 0 || inter == 0) return out;
    const int64_t elem = gate_up.element_size();
    const int64_t vf = 16 / elem;
    const bool vec_ok = inter % vf == 0 && lf_aligned16(gate_up.data_ptr()) &&
                        (gate_up.stride(0) * elem) % 16 == 0;
    auto stream = c10::cuda::getCurrentCUDAStream();
    LF_DISPATCH_FLOATING(gate_up.scalar_type(), "swiglu_fwd", [&] {
        using T = scalar_t;
        auto launch = [&]<int V>() {
            const Launch l = launch_for(rows, inter / V);
            if (p > 0.0) {
                swiglu_fwd_kernel<T, V, true><<<l.grid, l.block, 0, stream>>>(
                    gate_up.data_ptr<T>(), gate_up.stride(0), out.data_ptr<T>(), rows, inter, d);
            } else {
                swiglu_fwd_kernel<T, V, false><<<l.grid, l.block, 0, stream>>>(
                    gate_up.data_ptr<T>(), gate_up.stride(0), out.data_ptr<T>(), rows, inter, d);
            }
        };
        if (vec_ok) launch.template operator()<16 / sizeof(T)>();
        else launch.template operator()<1>();
        LF_CUDA_CHECK_LAUNCH();
    });
    return out;
}

at::Tensor swiglu_bwd_cuda(const at::Tensor& dout, const at::Tensor& gate_up, double p, int64_t seed,
                           int64_t offset) {
    LF_CHECK_CUDA(gate_up);
    LF_CHECK_CUDA(dout);
    LF_CHECK_ROWS(gate_up);
    LF_CHECK_CONTIGUOUS(dout);
    TORCH_CHECK(gate_up.size(1) % 2 == 0, "swiglu: the last dimension holds [gate | up] and must be "
                "even, got ", gate_up.size(1));
    LF_CHECK_SHAPE(dout, gate_up.size(0), gate_up.size(1) / 2);
    TORCH_CHECK(dout.scalar_type() == gate_up.scalar_type(), "swiglu_bwd: grad dtype ",
                dout.scalar_type(), " differs from input dtype ", gate_up.scalar_type());
    const DropoutArgs d = make_dropout_args(p, seed, offset);
    const c10::cuda::CUDAGuard guard(gate_up.device());
    const int64_t rows = gate_up.size(0);
    const int64_t inter = gate_up.size(1) / 2;
    auto dgate_up = at::empty({rows, 2 * inter}, gate_up.options());
    if (rows == 0 || inter == 0) return dgate_up;
    const int64_t elem = gate_up.element_size();
    const int64_t vf = 16 / elem;
    const bool vec_ok = inter % vf == 0 && lf_aligned16(gate_up.data_ptr()) &&
                        (gate_up.stride(0) * elem) % 16 == 0 && lf_aligned16(dout.data_ptr());
    auto stream = c10::cuda::getCurrentCUDAStream();
    LF_DISPATCH_FLOATING(gate_up.scalar_type(), "swiglu_bwd", [&] {
        using T = scalar_t;
        auto launch = [&]<int V>() {
            const Launch l = launch_for(rows, inter / V);
            if (p > 0.0) {
                swiglu_bwd_kernel<T, V, true><<<l.grid, l.block, 0, stream>>>(
                    dout.data_ptr<T>(), gate_up.data_ptr<T>(), gate_up.stride(0),
                    dgate_up.data_ptr<T>(), rows, inter, d);
            } else {
                swiglu_bwd_kernel<T, V, false><<<l.grid, l.block, 0, stream>>>(
                    dout.data_ptr<T>(), gate_up.data_ptr<T>(), gate_up.stride(0),
                    dgate_up.data_ptr<T>(), rows, inter, d);
            }
        };
        if (vec_ok) launch.template operator()<16 / sizeof(T)>();
        else launch.template operator()<1>();
        LF_CUDA_CHECK_LAUNCH();
    });
    return dgate_up;
}

}  // namespace loongforge
