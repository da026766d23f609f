// Averages gradients over the ranks in buckets while backward runs (data parallel).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "fusebox/core/distributed.h"

namespace fusebox::detail {

/// Averages the gradients of a fixed list of parameters over the ranks, in buckets that are the
/// same on every rank: they are planned once, from the parameter list alone (not from the
/// gradients a backward pass happens to produce), and launched strictly in bucket order, so every
/// rank issues the same sequence of all-reduces of the same sizes.
///
/// Plan: the trainable parameters (requires_grad leaves) in reverse order (gradients mostly
/// arrive last parameter first), one bucket per wire type (double stays double, every other
/// floating type travels as float), each bucket closed at `bucket_bytes` (the first at most
/// 1 MiB, so communication starts early), never across a segment (`segment_of`: the optimizer
/// groups, each then one bucket per wire type). Each parameter has a fixed offset in its bucket's
/// buffer, which ends with one element per parameter: 1 where this rank has a gradient, else 0,
/// summed by the same all-reduce into the number of ranks that had one.
///
/// A parameter without a gradient on a rank contributes zeros there. After the all-reduce every
/// rank holds the sum divided by the world size (DistributedDataParallel's average): a parameter
/// that some rank had a gradient for gets the average as its gradient on every rank (created
/// where it had none); one that no rank had a gradient for keeps none.
class GradReducer {
 public:
  /// Inactive (everything local) when `comm` is null or the world has one rank.
  GradReducer(std::shared_ptr<Communicator> comm, int64_t bucket_bytes);
  ~GradReducer();
  bool active() const { return comm_ != nullptr; }
  /// Plans the buckets over `params` (once, before the first backward pass); `segment_of[i]`, if
  /// given, is the segment of parameter i (a bucket never spans two).
  void plan(const std::vector<at::Tensor>& params, const std::vector<size_t>& segment_of = {});
  /// True when parameter `i` is averaged (it is a trainable leaf).
  bool averaged(size_t i) const;
  /// Parameter `i`'s gradient is final for this backward pass (it may be undefined: then it
  /// contributes zeros). Launches every bucket that is complete and whose predecessors are
  /// launched. Returns false, doing nothing, when `i` already arrived in this pass.
  bool arrived(size_t i);
  /// The end of backward: launches every bucket not launched yet, in order, with zeros for the
  /// parameters that did not arrive and have no gradient (a gradient kept from an earlier
  /// backward, when accumulating, is sent as it is).
  void launch_rest();
  /// Indices whose averages have finished and that some rank had a gradient for, in bucket
  /// order; with `wait`, those of all launched buckets, and (after launch_rest) the pass is over.
  /// Also waits for the oldest buckets while more than two buckets' bytes are in flight, so the
  /// gradients held for averaging stay bounded when the network is slower than backward.
  std::vector<size_t> completed(bool wait);
  /// After a failure: lets in-flight operations finish (ignoring their errors) and forgets the
  /// pass.
  void abandon();

 private:
  struct Bucket {
    std::vector<size_t> members;  // parameter indices, in buffer order
    std::vector<int64_t> offsets;
    int64_t numel = 0;  // gradient elements; one count per member follows
    int64_t bytes = 0;  // the members' bytes (for the in-flight bound)
    at::ScalarType wire = at::kFloat;
    size_t waiting = 0;      // members that have not arrived in this pass
    bool all_local = false;  // this rank had every member's gradient: the counts need no read
    at::Tensor buffer;
    std::unique_ptr<Communicator::Pending> pending;
  };
  void launch(Bucket& b);
  void unpack(Bucket& b, std::vector<size_t>& out);
  void reset_pass();

  std::shared_ptr<Communicator> comm_;
  int64_t bucket_bytes_;
  std::vector<at::Tensor> params_;
  std::vector<Bucket> buckets_;    // in launch order
  std::vector<size_t> bucket_of_;  // per parameter; npos when not averaged
  std::vector<bool> arrived_;      // per parameter, this pass
  size_t next_launch_ = 0;         // buckets [next_done_, next_launch_) are in flight
  size_t next_done_ = 0;
  int64_t in_flight_bytes_ = 0;
};

}  // namespace fusebox::detail
