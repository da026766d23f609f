// Averages gradients over the ranks in buckets while backward runs (data parallel).
#pragma once

#include <ATen/core/Tensor.h>

#include <deque>
#include <memory>
#include <vector>

#include "fusebox/core/distributed.h"

namespace fusebox::detail {

/// Queues gradients as they are accumulated and averages them in buckets. Completions are handed
/// back strictly in launch order, so every rank processes parameters in the same order.
class GradReducer {
 public:
  /// Inactive (everything local) when `comm` is null or the world has one rank.
  GradReducer(std::shared_ptr<Communicator> comm, int64_t bucket_bytes);
  ~GradReducer();
  bool active() const { return comm_ != nullptr; }
  /// Queues parameter `i`'s gradient; launches the bucket once it holds `bucket_bytes`.
  void add(size_t i, const at::Tensor& param);
  /// Launches whatever is queued as one bucket.
  void launch();
  /// Indices whose averages have finished, in launch order; with `wait`, all launched ones.
  /// Also waits for the oldest buckets while more than two buckets' bytes are in flight, so the
  /// gradients held for averaging stay bounded when the network is slower than backward.
  std::vector<size_t> completed(bool wait);
  /// After a failure: lets in-flight operations finish (ignoring their errors) and forgets all.
  void abandon();

 private:
  struct Bucket {
    std::vector<size_t> indices;
    std::unique_ptr<Communicator::Pending> pending;
    int64_t bytes = 0;
  };
  std::shared_ptr<Communicator> comm_;
  int64_t bucket_bytes_;
  std::vector<size_t> queued_;
  std::vector<at::Tensor> queued_grads_;
  int64_t queued_bytes_ = 0;
  int64_t in_flight_bytes_ = 0;
  bool first_of_pass_ = true;  // the first bucket of a backward pass is small (starts early)
  std::deque<Bucket> in_flight_;
};

}  // namespace fusebox::detail
