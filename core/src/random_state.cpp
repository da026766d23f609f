#include "fusebox/core/random_state.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>

#include <mutex>

namespace fusebox {

DefaultRngState::DefaultRngState(c10::Device device) {
  generators_.push_back(at::detail::getDefaultCPUGenerator());
  // A CPU-only LibTorch has no CUDA generator to ask for: only a GPU device's is taken.
  if (!device.is_cpu()) generators_.push_back(at::globalContext().defaultGenerator(device));
  for (auto& g : generators_) {
    const std::lock_guard<std::mutex> lock(g.mutex());
    states_.push_back(g.get_state());
  }
}

void DefaultRngState::restore() {
  for (size_t i = 0; i < generators_.size(); ++i) {
    const std::lock_guard<std::mutex> lock(generators_[i].mutex());
    generators_[i].set_state(states_[i]);
  }
}

}  // namespace fusebox
