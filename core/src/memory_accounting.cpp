#include "fusebox/core/memory_accounting.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <string>

#include "fusebox/core/memory_tracker.h"

namespace fusebox::memory {

Breakdown account(const StepMode& mode, int64_t measured_peak) {
  Breakdown b;
  b.measured_peak = measured_peak;
  int64_t largest_tensor = 0, largest_group = 0;
  for (const auto& opt : mode.optimizers()) {
    int64_t group_bytes = 0;
    for (size_t g = 0; g < opt->num_groups(); ++g)
      for (const auto& p : opt->group(g).params) {
        const int64_t bytes = p.numel() * static_cast<int64_t>(p.element_size());
        group_bytes += bytes;
        largest_tensor = std::max(largest_tensor, bytes);
      }
    b.weights += group_bytes;
    largest_group = std::max(largest_group, group_bytes);
    // Only the state tensors: a parameter's step counter (<param>/step) and the optimizer's
    // scalars (@optimizer/...) are host numbers, made into tensors only for the dict.
    static const std::string kStep = "/step";
    for (const auto& [key, t] : opt->state_dict()) {
      const bool counter = key.size() >= kStep.size() &&
                           key.compare(key.size() - kStep.size(), kStep.size(), kStep) == 0;
      if (key.rfind("@optimizer/", 0) != 0 && !counter)
        b.state += t.numel() * static_cast<int64_t>(t.element_size());
    }
  }
  b.all_grads = b.weights;  // gradients have their parameters' shapes and dtypes
  const std::string name = mode.name();
  b.grads_alive = name == "fused" ? largest_tensor : name == "groups" ? largest_group : b.all_grads;
  return b;
}

std::string describe(const Breakdown& b, const std::string& mode) {
  return "weights " + format_bytes(b.weights) + " + optimizer state " + format_bytes(b.state) +
         " + gradients alive " + format_bytes(b.grads_alive) + " (" + mode + " bound) + " +
         (b.ema > 0 ? "EMA " + format_bytes(b.ema) + " + " : std::string()) +
         "activations/scratch " + format_bytes(b.activations_and_scratch()) + " = peak " +
         format_bytes(b.measured_peak);
}

}  // namespace fusebox::memory
