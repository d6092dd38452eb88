// The expert GEMMs of the MoE layer as one CUTLASS 3 grouped GEMM (Hopper: TMA, wgmma, warp-specialized,
// persistent over all groups), with the group sizes read on the device from the routing's int32 group ends:
// no host sync, no padding. One template, instantiated per operand layout and tile configuration
// (grouped_gemm_<layout>_<config>.cu) so that ninja compiles them in parallel.
//
// Why our own and not torch's F.grouped_mm, which is the same CUTLASS kernel family: torch compiles one tile
// (128x256x64, cooperative) for every large problem. For the MoE layer's products whose output has 2048
// columns (down forward, gate_up input gradient at the e2e shapes) that tile leaves the last of ~8 waves a
// quarter full, and the weight gradient's short per-expert K wants a schedule whose epilogue overlaps the
// next tile's main loop (pingpong). benchmarks/diagnose_grouped_gemm.py measured torch's kernel 4-12% slower
// than cuBLAS on the same per-expert products (87181e1..ab44d7f).
//
// Modes (A, B, D as CUTLASS sees them: D[M, N] = A[M, K] * B[K, N], fp32 accumulation, bf16 out):
//   rows:   D = x[P, K] grouped by rows (group g: rows offs[g-1]..offs[g]) times W[g]; W stacked [G, N, K]
//           (B "column-major": the forward, y = x W[g]^T) or [G, K, N] (B row-major: the input gradient).
//   wgrad:  D[g] = a[rows of g]^T * b[rows of g], a [P, M], b [P, N] -> D [G, M, N]: the weight gradient,
//           K ragged. A group with no rows gets a zero D[g] (the GEMM skips it; a zero-fill kernel writes it).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/util/packed_stride.hpp>

#include <cstdint>

#include "grouped_gemm_api.h"
#include "lf_common.h"

namespace loongforge {
namespace grouped_gemm {

// Tile configurations. Cooperative: two consumer warpgroups share one tile (the large tiles).
// Pingpong: each consumer warpgroup owns a tile, one's epilogue runs under the other's main loop.
struct Coop128x256 {
    using TileShape = cute::Shape<cute::_128, cute::_256, cute::_64>;
    using ClusterShape = cute::Shape<cute::_2, cute::_1, cute::_1>;
    using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
    using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
struct Coop256x128 {
    using TileShape = cute::Shape<cute::_256, cute::_128, cute::_64>;
    using ClusterShape = cute::Shape<cute::_1, cute::_2, cute::_1>;
    using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
    using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
struct Pong128x128 {
    using TileShape = cute::Shape<cute::_128, cute::_128, cute::_64>;
    using ClusterShape = cute::Shape<cute::_2, cute::_1, cute::_1>;
    using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
    using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};


template <class StrideA, class StrideB, class StrideD, class ElementA, class ElementB, class ElementD,
          class ProblemShape>
__global__ void prepare_groups_kernel(Call call, ElementA const** ptr_a, ElementB const** ptr_b, ElementD** ptr_d,
                                      StrideA* stride_a, StrideB* stride_b, StrideD* stride_d,
                                      ProblemShape* shapes, StrideA sa, StrideB sb, StrideD sd) {
    const int g = blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= call.groups) return;
    const int64_t start = g == 0 ? 0 : call.offs[g - 1];
    const int rows = static_cast<int>(call.offs[g] - start);
    auto a = static_cast<ElementA const*>(call.a);
    auto b = static_cast<ElementB const*>(call.b);
    auto d = static_cast<ElementD*>(call.d);
    if (call.mode == Mode::kWgrad) {
        // D[g] = a[rows]^T b[rows]: A is a's rows viewed column-major (M contiguous), B is b's rows row-major
        ptr_a[g] = a + start * call.m;
        ptr_b[g] = b + start * call.n;
        ptr_d[g] = d + static_cast<int64_t>(g) * call.m * call.n;
        // no rows: no tiles (the zero-fill kernel writes D[g]); CUTLASS is not asked for a K = 0 main loop
        shapes[g] = rows == 0 ? ProblemShape{0, call.n, 0} : ProblemShape{call.m, call.n, rows};
    } else {
        ptr_a[g] = a + start * call.k;
        ptr_b[g] = b + static_cast<int64_t>(g) * call.n * call.k;
        ptr_d[g] = d + start * call.n;
        shapes[g] = ProblemShape{rows, call.n, call.k};
    }
    stride_a[g] = sa;
    stride_b[g] = sb;
    stride_d[g] = sd;
}

template <class LayoutA, class LayoutB, class Config>
struct GroupedGemm {
    using Element = cutlass::bfloat16_t;
    using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
    static constexpr int kAlign = 16 / sizeof(Element);

    using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Config::TileShape,
        typename Config::ClusterShape, cutlass::epilogue::collective::EpilogueTileAuto, float, float,
        void, cutlass::layout::RowMajor*, kAlign,  // no source C: D = acc
        Element, cutlass::layout::RowMajor*, kAlign, typename Config::EpilogueSchedule,
        cutlass::epilogue::fusion::LinearCombination<Element, float, void, float>>::CollectiveOp;

    using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA*, kAlign, Element, LayoutB*,
        kAlign, float, typename Config::TileShape, typename Config::ClusterShape,
        cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
            sizeof(typename CollectiveEpilogue::SharedStorage))>,
        typename Config::KernelSchedule>::CollectiveOp;

    using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
    using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
    using StrideA = typename Kernel::InternalStrideA;
    using StrideB = typename Kernel::InternalStrideB;
    using StrideD = typename Kernel::InternalStrideD;
    using Shape = typename ProblemShape::UnderlyingProblemShape;

    static void run(const Call& call, const at::Tensor& like) {
        const int g = call.groups;
        // one device buffer for the per-group arguments: pointers first (8-byte aligned), then strides, shapes
        const int64_t bytes = static_cast<int64_t>(g) *
            (3 * sizeof(void*) + sizeof(StrideA) + sizeof(StrideB) + sizeof(StrideD) + sizeof(Shape)) + 64;
        at::Tensor args_buf = at::empty({bytes}, like.options().dtype(at::kByte));
        char* p = static_cast<char*>(args_buf.data_ptr());
        auto take = [&p](int64_t n) {
            char* q = p;
            p += (n + 15) / 16 * 16;
            return q;
        };
        auto ptr_a = reinterpret_cast<Element const**>(take(g * sizeof(void*)));
        auto ptr_b = reinterpret_cast<Element const**>(take(g * sizeof(void*)));
        auto ptr_d = reinterpret_cast<Element**>(take(g * sizeof(void*)));
        auto stride_a = reinterpret_cast<StrideA*>(take(g * sizeof(StrideA)));
        auto stride_b = reinterpret_cast<StrideB*>(take(g * sizeof(StrideB)));
        auto stride_d = reinterpret_cast<StrideD*>(take(g * sizeof(StrideD)));
        auto shapes = reinterpret_cast<Shape*>(take(g * sizeof(Shape)));
        TORCH_INTERNAL_ASSERT(p <= static_cast<char*>(args_buf.data_ptr()) + bytes + 16 * 8);

        // every group's operands are packed with the same leading dimensions: one stride each, for all groups
        const bool wgrad = call.mode == Mode::kWgrad;
        const int m_for_a = wgrad ? call.m : 1, k_for_a = wgrad ? 1 : call.k;
        StrideA sa = cutlass::make_cute_packed_stride(StrideA{}, cute::make_shape(m_for_a, k_for_a, 1));
        StrideB sb = cutlass::make_cute_packed_stride(
            StrideB{}, cute::make_shape(call.n, wgrad ? 1 : call.k, 1));
        StrideD sd = cutlass::make_cute_packed_stride(StrideD{}, cute::make_shape(1, call.n, 1));
        prepare_groups_kernel<<<(g + 127) / 128, 128, 0, call.stream>>>(
            call, ptr_a, ptr_b, ptr_d, stride_a, stride_b, stride_d, shapes, sa, sb, sd);
        C10_CUDA_KERNEL_LAUNCH_CHECK();

        typename Gemm::Arguments arguments{
            cutlass::gemm::GemmUniversalMode::kGrouped,
            {g, shapes, nullptr},
            {ptr_a, stride_a, ptr_b, stride_b},
            {{}, nullptr, nullptr, ptr_d, stride_d}};
        arguments.epilogue.thread.alpha = 1.0f;
        arguments.epilogue.thread.beta = 0.0f;
        arguments.hw_info.device_id = like.device().index();
        arguments.hw_info.sm_count = call.sm_count;

        Gemm gemm;
        const size_t workspace_bytes = Gemm::get_workspace_size(arguments);
        at::Tensor workspace = at::empty({static_cast<int64_t>(workspace_bytes) + 1},
                                         like.options().dtype(at::kByte));
        LF_CHECK(gemm.can_implement(arguments) == cutlass::Status::kSuccess,
                 "grouped_gemm: CUTLASS cannot run this problem (groups=", g, ", m=", call.m, ", n=", call.n,
                 ", k=", call.k, "); rows must be 16-byte aligned (sizes a multiple of 8 bf16 elements)");
        LF_CHECK(gemm.initialize(arguments, workspace.data_ptr(), call.stream) == cutlass::Status::kSuccess,
                 "grouped_gemm: CUTLASS could not initialize the grouped GEMM");
        LF_CHECK(gemm.run(call.stream) == cutlass::Status::kSuccess, "grouped_gemm: the CUTLASS kernel did not launch");
        C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
};

}  // namespace grouped_gemm
}  // namespace loongforge

// LF_GROUPED_GEMM_INSTANCE(fn, LayoutA, LayoutB, config index, Config): defines fn_<index>
#define LF_GROUPED_GEMM_INSTANCE(fn, LA, LB, index, Config)                                             \
    namespace loongforge {                                                                              \
    namespace grouped_gemm {                                                                            \
    void fn##_##index(const Call& call, const at::Tensor& like) {                                      \
        GroupedGemm<LA, LB, Config>::run(call, like);                                                   \
    }                                                                                                   \
    }                                                                                                   \
    }
