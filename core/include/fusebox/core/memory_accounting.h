// The analytic side of memory accounting: what a step mode must keep alive, next to what was
// measured (see ../shared notes in docs/benchmarks.md for the model).
//
//   normal: peak >= weights + state + all gradients (+ activations during backward)
//   fused:  peak >= weights + state + peak activations + the largest single gradient
//   groups: peak >= weights + state + peak activations + the largest group's gradients
#pragma once

#include <cstdint>
#include <string>

#include "fusebox/core/step_mode.h"

namespace fusebox::memory {

/// Bytes by kind for one step mode; `measured_peak` comes from the tracker.
struct Breakdown {
  int64_t weights = 0;        ///< trainable parameters
  int64_t state = 0;          ///< optimizer state (all instances)
  int64_t grads_alive = 0;    ///< gradients the mode keeps alive at once (its bound)
  int64_t all_grads = 0;      ///< every gradient (what the normal loop holds)
  int64_t ema = 0;            ///< an average of the parameters (ParameterEma), if kept
  int64_t measured_peak = 0;  ///< from the counting allocator / CUDA statistics
  /// weights + state + grads_alive (+ ema): the floor before activations.
  int64_t floor() const { return weights + state + grads_alive + ema; }
  /// What the peak holds beyond the floor: activations and scratch.
  int64_t activations_and_scratch() const { return measured_peak - floor(); }
};

/// Accounts `mode`'s weights, state and gradient bound; `measured_peak` is copied in.
Breakdown account(const StepMode& mode, int64_t measured_peak);

/// One line: "weights 1.0 MiB + state 2.0 MiB + gradients alive 0.1 MiB (fused bound) +
/// activations/scratch 3.0 MiB = peak 6.1 MiB".
std::string describe(const Breakdown& b, const std::string& mode);

}  // namespace fusebox::memory
