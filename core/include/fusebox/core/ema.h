// An exponential moving average (EMA) of the parameters, the weights diffusion and language
// models are usually evaluated and shipped with: after each optimizer step,
//   avg ← d·avg + (1 − d)·param,   d = min(decay, (1 + t) / (10 + t)),
// t the number of updates before this one (diffusers' EMAModel: the warm-up keeps the average
// from clinging to the initial weights). It runs after the step in every mode, so the normal loop,
// the fused backward pass and optimizer groups give the same average.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace fusebox {

class ParameterEma {
 public:
  /// Averages `params` (name -> tensor), starting from their current values. Reduced-precision
  /// parameters (bf16, fp16) are averaged in float32, others in their own dtype. `decay` in
  /// (0, 1), else Error.
  ParameterEma(std::vector<std::pair<std::string, at::Tensor>> params, double decay);

  /// One update, after an optimizer step (not after a skipped one).
  void update();
  /// The decay the next update() applies.
  double next_decay() const;
  /// Updates applied so far.
  int64_t updates() const { return updates_; }
  /// The averages, by parameter name.
  const std::map<std::string, at::Tensor>& averages() const { return averages_; }

  /// Restores saved averages and the update count (a checkpoint's). Names, shapes and dtypes must
  /// match those this EMA keeps; else Error naming the first difference, and nothing changes.
  void load(const std::map<std::string, at::Tensor>& averages, int64_t updates);

  /// While alive, the parameters hold the averages (for evaluation or saving); the destructor
  /// puts the trained values back, bit for bit, in their own storage. A parameter whose average
  /// has its dtype trades storages with it (no copy, no memory: averages() holds the trained
  /// values meanwhile); a bf16/fp16 one is copied, its trained values kept aside.
  class Swap {
   public:
    explicit Swap(ParameterEma& ema);
    ~Swap();
    Swap(const Swap&) = delete;
    Swap& operator=(const Swap&) = delete;

   private:
    ParameterEma& ema_;
    std::vector<at::Tensor> saved_;  ///< per parameter: its trained values, or undefined if traded
  };

 private:
  std::vector<std::pair<std::string, at::Tensor>> params_;
  std::map<std::string, at::Tensor> averages_;
  double decay_;
  int64_t updates_ = 0;
};

}  // namespace fusebox
