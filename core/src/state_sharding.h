// ZeRO stage 1 inside the step modes: which parameters this rank steps, and the broadcast that
// brings every rank's updated share to the others.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

#include "fusebox/core/distributed.h"
#include "fusebox/core/step_mode.h"

namespace fusebox::detail {

class StateSharding {
 public:
  /// Active when `o` asks for sharding and has a communicator with more than one rank.
  StateSharding() = default;
  StateSharding(const StepOptions& o, const std::vector<at::Tensor>& params);
  bool active() const { return comm_ != nullptr; }
  /// True when this rank steps parameter `i` (always true when inactive).
  bool owns(size_t i) const { return !comm_ || owner_[i] == comm_->rank(); }
  /// Frees the gradients of the parameters in [first, last) that another rank steps.
  void drop_foreign_grads(const std::vector<at::Tensor>& params, size_t first, size_t last) const;
  /// Sends every rank's parameters to all others (after the step); blocks until done.
  void broadcast(const std::vector<at::Tensor>& params) const;

 private:
  std::shared_ptr<Communicator> comm_;
  std::vector<int> owner_;
};

}  // namespace fusebox::detail
