#include "grad_reducer.h"

#include <ATen/ATen.h>

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
  if (queued_bytes_ >= bucket_bytes_) launch();
}

void GradReducer::launch() {
  if (queued_.empty()) return;
  Bucket b;
  b.indices = std::move(queued_);
  b.pending = comm_->average(std::move(queued_grads_));
  in_flight_.push_back(std::move(b));
  queued_.clear();
  queued_grads_.clear();
  queued_bytes_ = 0;
}

std::vector<size_t> GradReducer::completed(bool wait) {
  std::vector<size_t> out;
  while (!in_flight_.empty()) {
    Bucket& b = in_flight_.front();
    if (!wait && !b.pending->done()) break;
    b.pending->wait();  // also unpacks the averaged values into the gradients
    out.insert(out.end(), b.indices.begin(), b.indices.end());
    in_flight_.pop_front();
  }
  return out;
}

void GradReducer::abandon() {
  queued_.clear();
  queued_grads_.clear();
  queued_bytes_ = 0;
  in_flight_.clear();  // each Pending waits for its operation before releasing the buffers
}

}  // namespace fusebox::detail
