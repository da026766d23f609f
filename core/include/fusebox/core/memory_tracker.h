// Tensor memory accounting: current and peak bytes of live tensors, with phases marked so a
// report shows where the peak happens.
//
// On CPU a counting allocator wraps LibTorch's default one (installed once, process-wide, before
// the first tensor worth counting is made). On CUDA the caching allocator's own statistics are
// read. BLAS/oneDNN scratch memory is not seen by either.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace fusebox::memory {

/// Installs the counting CPU allocator (idempotent). Tensors made before are not counted.
void install_cpu_tracking();
/// True once install_cpu_tracking() has run.
bool cpu_tracking_installed();

/// Guards against the kernel's out-of-memory killer, which ends a process without a word: a
/// counted CPU allocation that would leave less than `reserve` bytes of what `available()` says
/// is free (e.g. host::available_memory; -1: unknown, allowed) is refused, before any memory is
/// touched, with a c10::Error whose message starts kGuardRefusal. `available` is asked only when
/// an allocation would pass its last answer or is large (64 MiB or more), so small allocations
/// cost nothing more. An empty `available` removes the guard.
void set_cpu_guard(std::function<int64_t()> available, int64_t reserve);
/// How a refusal by the guard starts: "memory guard: cannot allocate N bytes: M bytes are free
/// (R kept in reserve) and this process's tensors hold T bytes".
inline constexpr const char* kGuardRefusal = "memory guard: cannot allocate ";

/// Bytes of live CPU tensors allocated since installation.
int64_t current_bytes();
/// Highest current_bytes() since the last reset_peak().
int64_t peak_bytes();
/// Starts a new peak window at the current level (also clears phase peaks), for the counted CPU
/// tensors and for the CUDA caching allocator's peaks in cuda_stats().
void reset_peak();

/// Marks the start of a phase ("forward", "backward", "step", ...); peaks are kept per phase.
void mark_phase(const std::string& phase);
/// One phase's peak.
struct PhasePeak {
  std::string phase;
  int64_t peak_bytes;
};
/// Peak per phase since the last reset_peak(), in first-seen order.
std::vector<PhasePeak> phase_peaks();

/// CUDA caching allocator statistics of the current device (zeros without CUDA).
struct CudaStats {
  int64_t allocated = 0, peak_allocated = 0, reserved = 0, peak_reserved = 0;
};
CudaStats cuda_stats();

/// "12.3 MiB"-style rendering of a byte count, up to EiB. A double, so that an estimate beyond
/// int64 (a model sized by mistake) is shown as it is rather than wrapped around.
std::string format_bytes(double bytes);

}  // namespace fusebox::memory
