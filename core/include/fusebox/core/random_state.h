// The states of the default random generators, to put back later: a computation run a second
// time (a recomputed checkpoint segment) then draws the same numbers as the first time, and one
// run on the side (an evaluation) leaves the training's random stream as it was.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <vector>

namespace fusebox {

/// The states of the CPU's default generator and, for a GPU `device`, that device's.
class DefaultRngState {
 public:
  DefaultRngState() = default;  ///< holds nothing: restore() does nothing
  explicit DefaultRngState(c10::Device device);
  /// Puts each generator back to the state it had when this was made.
  void restore();

 private:
  std::vector<at::Generator> generators_;
  std::vector<at::Tensor> states_;
};

/// Restores the default generators of `device` (and the CPU's) when the scope ends.
class KeepDefaultRng {
 public:
  explicit KeepDefaultRng(c10::Device device) : saved_(device) {}
  ~KeepDefaultRng() { saved_.restore(); }
  KeepDefaultRng(const KeepDefaultRng&) = delete;
  KeepDefaultRng& operator=(const KeepDefaultRng&) = delete;

 private:
  DefaultRngState saved_;
};

}  // namespace fusebox
