// Loss scaling for fp16 training.
//
// fp16 holds nothing below about 6e-8, so small gradients computed in it become zero. The loss is
// multiplied by a scale before backward, which lifts every gradient by the same factor, and each
// gradient is divided by it again before it is checked, clipped or used. A power-of-two scale
// changes no bit of a float gradient (unless it overflows), so a scaled run trains exactly as an
// unscaled one wherever neither underflows.
//
// Dynamic scaling (the rule of torch.cuda.amp.GradScaler): an iteration whose gradients overflowed
// is skipped and the scale multiplied by backoff_factor; after growth_interval good iterations in
// a row it is multiplied by growth_factor. Only the normal step mode can skip an iteration after
// seeing every gradient: the fused backward pass and optimizer groups have applied the earlier
// ones by then, so they take a fixed scale (an overflow is then a non-finite gradient, handled by
// NonFinitePolicy).
#pragma once

#include <cstdint>

namespace fusebox {

struct LossScaleOptions {
  double scale = 65536;  ///< the fixed scale, or the dynamic one's start (finite, > 0)
  bool dynamic = true;
  double growth_factor = 2;        ///< dynamic: > 1
  double backoff_factor = 0.5;     ///< dynamic: in (0, 1)
  int64_t growth_interval = 2000;  ///< dynamic: good iterations before the scale grows (>= 1)
  /// Dynamic: an overflow that would take the scale below this means the gradients are not finite
  /// at any scale (rather than merely too large for fp16): update() refuses it.
  double min_scale = 1.0 / 65536;
};

/// The current scale and the dynamic rule's progress. Cheap to copy; no tensors.
class LossScaler {
 public:
  /// Throws fusebox::Error on options outside the ranges above.
  explicit LossScaler(LossScaleOptions options = {});

  double scale() const { return scale_; }
  bool dynamic() const { return options_.dynamic; }
  /// Good iterations since the scale last changed.
  int64_t good_steps() const { return good_steps_; }
  const LossScaleOptions& options() const { return options_; }

  /// Records an iteration's outcome: an overflow lowers a dynamic scale, a good iteration may
  /// raise it. Returns false, changing nothing, when an overflow would take the scale below
  /// min_scale. A fixed scale never changes.
  bool update(bool overflow);
  /// Continues from saved values (a resumed run); throws fusebox::Error on values that cannot
  /// come from update().
  void restore(double scale, int64_t good_steps);

 private:
  LossScaleOptions options_;
  double scale_;
  int64_t good_steps_ = 0;
};

}  // namespace fusebox
