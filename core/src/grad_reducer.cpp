#include "grad_reducer.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <limits>

#include "fusebox/error.h"

namespace fusebox::detail {

namespace {

constexpr size_t kNone = std::numeric_limits<size_t>::max();

}  // namespace

GradReducer::GradReducer(std::shared_ptr<Communicator> comm, int64_t bucket_bytes)
    : comm_(comm && comm->world_size() > 1 ? std::move(comm) : nullptr),
      bucket_bytes_(bucket_bytes) {}

GradReducer::~GradReducer() { abandon(); }

void GradReducer::plan(const std::vector<at::Tensor>& params,
                       const std::vector<size_t>& segment_of) {
  params_ = params;
  buckets_.clear();
  bucket_of_.assign(params.size(), kNone);
  arrived_.assign(params.size(), false);
  if (!comm_) return;
  // Like DDP: the first bucket is at most 1 MiB, so communication starts early (not within
  // segments: each optimizer group is averaged as one bucket).
  const bool small_first = segment_of.empty();
  struct Open {
    at::Device device;
    at::ScalarType wire;
    Bucket bucket;
  };
  std::vector<Open> open;  // at most one per (device, wire type), in the order they were opened
  auto close = [&](size_t k) {
    buckets_.push_back(std::move(open[k].bucket));
    open.erase(open.begin() + static_cast<std::ptrdiff_t>(k));
  };
  size_t segment = kNone;
  for (size_t n = params.size(); n-- > 0;) {
    const at::Tensor& p = params[n];
    if (!p.defined() || !p.requires_grad() || !p.is_leaf()) continue;
    if (!p.is_floating_point())
      throw Error(std::string("data-parallel gradient averaging takes floating-point parameters "
                              "only, not ") +
                  c10::toString(p.scalar_type()));
    const size_t s = segment_of.empty() ? 0 : segment_of[n];
    if (s != segment)
      while (!open.empty()) close(0);
    segment = s;
    const at::ScalarType wire = average_wire_type(p.scalar_type());
    size_t k = 0;
    while (k < open.size() && (open[k].device != p.device() || open[k].wire != wire)) ++k;
    if (k == open.size()) {
      open.push_back({p.device(), wire, Bucket{}});
      open.back().bucket.wire = wire;
    }
    Bucket& b = open[k].bucket;
    b.members.push_back(n);
    b.offsets.push_back(b.numel);
    b.numel += p.numel();
    b.bytes += p.numel() * static_cast<int64_t>(p.element_size());
    const int64_t cap =
        small_first && buckets_.empty() ? std::min<int64_t>(bucket_bytes_, 1 << 20) : bucket_bytes_;
    if (b.bytes >= cap) close(k);
  }
  while (!open.empty()) close(0);
  for (size_t k = 0; k < buckets_.size(); ++k)
    for (size_t i : buckets_[k].members) bucket_of_[i] = k;
  reset_pass();
}

bool GradReducer::averaged(size_t i) const {
  return i < bucket_of_.size() && bucket_of_[i] != kNone;
}

bool GradReducer::arrived(size_t i) {
  if (!averaged(i)) return true;
  if (arrived_[i]) return false;
  arrived_[i] = true;
  --buckets_[bucket_of_[i]].waiting;
  // Strictly in bucket order: a complete bucket waits for the ones before it.
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].waiting == 0)
    launch(buckets_[next_launch_++]);
  return true;
}

void GradReducer::launch_rest() {
  while (next_launch_ < buckets_.size()) launch(buckets_[next_launch_++]);
}

void GradReducer::launch(Bucket& b) {
  at::NoGradGuard no_grad;
  const size_t m = b.members.size();
  b.buffer =
      at::empty({b.numel + static_cast<int64_t>(m)}, params_[b.members[0]].options().dtype(b.wire));
  std::vector<double> had(m, 0.0);
  for (size_t j = 0; j < m; ++j) {
    const at::Tensor& p = params_[b.members[j]];
    at::Tensor slot = b.buffer.narrow(0, b.offsets[j], p.numel());
    const at::Tensor& grad = p.grad();
    if (grad.defined()) {
      slot.copy_(grad.reshape({-1}));
      had[j] = 1;
    } else {
      slot.zero_();
    }
  }
  b.buffer.narrow(0, b.numel, static_cast<int64_t>(m))
      .copy_(at::tensor(had, at::TensorOptions(at::kDouble)));
  b.all_local = std::all_of(had.begin(), had.end(), [](double h) { return h > 0; });
  in_flight_bytes_ += b.bytes;
  // One contiguous tensor of a wire type: summed and divided by the world size in place.
  b.pending = comm_->average({b.buffer});
}

void GradReducer::unpack(Bucket& b, std::vector<size_t>& out) {
  at::NoGradGuard no_grad;
  const size_t m = b.members.size();
  // The counts, divided by the world size like the rest: positive where some rank had a gradient.
  // Read back (a host sync on a GPU) only when this rank lacked a member's gradient: otherwise
  // every count is positive.
  at::Tensor counts;
  if (!b.all_local)
    counts = b.buffer.narrow(0, b.numel, static_cast<int64_t>(m)).to(at::kCPU, at::kDouble);
  const double* had = b.all_local ? nullptr : counts.data_ptr<double>();
  for (size_t j = 0; j < m; ++j) {
    if (had && !(had[j] > 0)) continue;  // no rank had a gradient: none here either
    const size_t i = b.members[j];
    const at::Tensor& p = params_[i];
    const at::Tensor avg = b.buffer.narrow(0, b.offsets[j], p.numel()).view(p.sizes());
    if (p.grad().defined()) {
      p.grad().copy_(avg);
    } else {  // another rank had one: this rank steps with the average too
      at::Tensor g = at::empty_like(p, at::MemoryFormat::Preserve);
      g.copy_(avg);
      p.mutable_grad() = g;
    }
    out.push_back(i);
  }
  b.buffer = at::Tensor();
}

std::vector<size_t> GradReducer::completed(bool wait) {
  std::vector<size_t> out;
  const bool bounded = bucket_bytes_ < std::numeric_limits<int64_t>::max() / 2;
  while (next_done_ < next_launch_) {
    Bucket& b = buckets_[next_done_];
    const bool too_much = bounded && in_flight_bytes_ > 2 * bucket_bytes_;
    if (!wait && !too_much && !b.pending->done()) break;
    b.pending->wait();
    b.pending.reset();
    unpack(b, out);
    in_flight_bytes_ -= b.bytes;
    ++next_done_;
  }
  if (wait) {
    if (next_launch_ != buckets_.size())
      throw Error("internal error: gradient buckets waited for before all were launched");
    reset_pass();
  }
  return out;
}

void GradReducer::reset_pass() {
  for (Bucket& b : buckets_) {
    b.waiting = b.members.size();
    b.pending.reset();  // each Pending waits for its operation before releasing the buffers
    b.buffer = at::Tensor();
  }
  arrived_.assign(params_.size(), false);
  next_launch_ = next_done_ = 0;
  in_flight_bytes_ = 0;
}

void GradReducer::abandon() {
  // Destroying a Pending waits for its operation (ignoring errors) before the buffer goes.
  reset_pass();
}

}  // namespace fusebox::detail
