// Tensor memory accounting: current and peak bytes of live tensors, with phases marked so a
// report shows where the peak happens.
//
// On CPU a counting allocator wraps LibTorch's default one (installed once, process-wide, before
// the first tensor worth counting is made). On CUDA the caching allocator's own statistics are
// read. BLAS/oneDNN scratch memory is not seen by either.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fusebox::memory {

/// Installs the counting CPU allocator (idempotent). Tensors made before are not counted.
void install_cpu_tracking();
/// True once install_cpu_tracking() has run.
bool cpu_tracking_installed();

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
