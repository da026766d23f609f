#include "grad_reducer.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <limits>

namespace fusebox::detail {

GradReducer::GradReducer(std::shared_ptr<Communicator> comm, int64_t bucket_bytes)
    : comm_(comm && comm->world_size() > 1 ? std::move(comm) : nullptr),
      bucket_bytes_(bucket_bytes) {}

GradReducer::~GradReducer() { abandon(); }

void GradReducer::add(size_t i, const at::Tensor& param) {
  const at::Tensor& grad = param.grad();
  queued_.push_back(i);
  queued_grads_.push_back(grad);
  queued_bytes_ += grad.numel() * grad.element_size();
  // Like DDP: the first bucket of a pass is at most 1 MiB, so communication starts early.
  const int64_t cap = first_of_pass_ ? std::min<int64_t>(bucket_bytes_, 1 << 20) : bucket_bytes_;
  if (queued_bytes_ >= cap) launch();
}

void GradReducer::launch() {
  if (queued_.empty()) return;
  Bucket b;
  b.bytes = queued_bytes_;
  in_flight_bytes_ += b.bytes;
  first_of_pass_ = false;
  b.indices = std::move(queued_);
  b.pending = comm_->average(std::move(queued_grads_));
  in_flight_.push_back(std::move(b));
  queued_.clear();
  queued_grads_.clear();
  queued_bytes_ = 0;
}

std::vector<size_t> GradReducer::completed(bool wait) {
  std::vector<size_t> out;
  const bool bounded = bucket_bytes_ < std::numeric_limits<int64_t>::max() / 2;
  while (!in_flight_.empty()) {
    Bucket& b = in_flight_.front();
    const bool too_much = bounded && in_flight_bytes_ > 2 * bucket_bytes_;
    if (!wait && !too_much && !b.pending->done()) break;
    b.pending->wait();  // also unpacks the averaged values into the gradients
    out.insert(out.end(), b.indices.begin(), b.indices.end());
    in_flight_bytes_ -= b.bytes;
    in_flight_.pop_front();
  }
  if (wait) first_of_pass_ = true;  // everything is back: the next add starts a new pass
  return out;
}

void GradReducer::abandon() {
  queued_.clear();
  queued_grads_.clear();
  queued_bytes_ = 0;
  in_flight_bytes_ = 0;
  first_of_pass_ = true;
  in_flight_.clear();  // each Pending waits for its operation before releasing the buffers
}

}  // namespace fusebox::detail
