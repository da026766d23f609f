// CPU compute threads: LibTorch's intra-op pool and the BLAS library's own pool.
#pragma once

namespace fusebox {

/// The thread counts in effect after set_compute_threads().
struct ComputeThreads {
  int intra_op = 0;            ///< LibTorch intra-op threads (elementwise ops, reductions)
  int blas = 0;                ///< BLAS threads (matrix products); 0: the BLAS cannot be asked
  bool blas_from_env = false;  ///< OPENBLAS_NUM_THREADS is set, so the BLAS was left as it is
};

/// Sets LibTorch's intra-op threads to `intra_op` (>= 1) and, when `blas` > 0 and the BLAS is
/// OpenBLAS (Debian's LibTorch calls it through libblas.so.3), OpenBLAS's threads to `blas`.
///
/// Why a second number: `at::set_num_threads` does not reach OpenBLAS, which starts one thread
/// per core on its own, so "one thread" is not one thread. The two pools want different sizes:
/// on a 2-core machine, matrix products gain from every core while small elementwise ops lose
/// to waking OpenMP workers (docs/benchmarks.md has the figures). An explicit
/// OPENBLAS_NUM_THREADS in the environment is respected. (MKL, in official LibTorch builds,
/// follows `at::set_num_threads` already.)
ComputeThreads set_compute_threads(int intra_op, int blas = 0);

/// OpenBLAS's thread count now (0 when the BLAS cannot be asked). An OpenMP build of OpenBLAS
/// answers with OpenMP's current count, so it follows set_compute_threads' intra-op number.
int blas_threads_now();

/// The cores this process may use (at least 1): its CPU affinity mask, lowered to a cgroup CPU
/// quota (fusebox/core/host_resources.h). The default size of both pools.
int available_cores();

}  // namespace fusebox
