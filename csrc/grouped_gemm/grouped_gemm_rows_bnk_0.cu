// run_rows_bnk with the Coop128x256 tile configuration (one instantiation per file: ninja compiles them in parallel)
#include "grouped_gemm_kernel.cuh"

LF_GROUPED_GEMM_INSTANCE(run_rows_bnk, cutlass::layout::RowMajor, cutlass::layout::ColumnMajor, 0, Coop128x256)
