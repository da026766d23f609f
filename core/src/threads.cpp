// Sizes LibTorch's and the BLAS library's thread pools.
#include "fusebox/core/threads.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <string>

#include "fusebox/core/host_resources.h"
#include "fusebox/error.h"

namespace fusebox {

namespace {

// OpenBLAS's own calls, looked up at run time: the BLAS behind libblas.so.3 is chosen by the
// system (Debian's alternatives), so fusebox links none of them.
using SetThreads = void (*)(int);
using GetThreads = int (*)();

template <typename Fn>
Fn find_symbol(const char* name) {
  return reinterpret_cast<Fn>(dlsym(RTLD_DEFAULT, name));
}

}  // namespace

ComputeThreads set_compute_threads(int intra_op, int blas) {
  if (intra_op < 1)
    throw Error("intra-op threads must be at least 1, got " + std::to_string(intra_op));
  if (blas < 0) throw Error("BLAS threads must be at least 0, got " + std::to_string(blas));
  at::set_num_threads(intra_op);
  ComputeThreads out;
  out.intra_op = at::get_num_threads();
  const auto set_blas = find_symbol<SetThreads>("openblas_set_num_threads");
  const auto get_blas = find_symbol<GetThreads>("openblas_get_num_threads");
  const char* env = std::getenv("OPENBLAS_NUM_THREADS");
  out.blas_from_env = env != nullptr && *env != '\0';
  if (set_blas && blas > 0 && !out.blas_from_env) set_blas(blas);
  if (get_blas) out.blas = get_blas();
  return out;
}

int blas_threads_now() {
  const auto get_blas = find_symbol<GetThreads>("openblas_get_num_threads");
  return get_blas ? get_blas() : 0;
}

int available_cores() { return host::usable_cores(); }

}  // namespace fusebox
