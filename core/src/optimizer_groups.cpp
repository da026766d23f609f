// Optimizer groups: N optimizer instances over contiguous slices of the parameters; each slice
// steps, and frees its gradients, as soon as its last gradient has been accumulated.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <limits>

#include "step_mode_common.h"

namespace fusebox {

namespace {

struct Item {
  size_t group, index;
  int64_t bytes;
};

// Contiguous cut points of `items` into exactly `n` pieces (n <= items), with each piece at most
// `capacity` bytes where possible. Returns the start index of every piece, or empty when
// `capacity` is too small.
std::vector<size_t> cut(const std::vector<Item>& items, size_t n, int64_t capacity) {
  std::vector<size_t> starts{0};
  int64_t acc = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    const size_t pieces_left = n - starts.size();  // pieces still to open after this one
    const size_t items_left = items.size() - i;    // including item i
    const bool must_cut = i > 0 && items_left == pieces_left;  // one item per remaining piece
    if (i > 0 && (must_cut || acc + items[i].bytes > capacity)) {
      if (starts.size() == n) return {};  // would need more pieces than allowed
      starts.push_back(i);
      acc = 0;
    }
    acc += items[i].bytes;
    if (acc > capacity) return {};  // a single tensor larger than the capacity
  }
  return starts;
}

}  // namespace

std::vector<std::vector<ParamGroup>> split_param_groups(const std::vector<ParamGroup>& groups,
                                                        int64_t n, SplitPolicy policy) {
  if (n < 1)
    throw Error("optimizer groups: the number of groups must be at least 1, got " +
                std::to_string(n));
  std::vector<Item> items;
  for (size_t g = 0; g < groups.size(); ++g)
    for (size_t i = 0; i < groups[g].params.size(); ++i)
      items.push_back({g, i, groups[g].params[i].numel() * groups[g].params[i].element_size()});
  if (items.empty()) throw Error("no trainable parameters to split into optimizer groups");
  // At most one piece per tensor. A piece may span parameter groups: it becomes one optimizer
  // holding a part of each, with each part's own lr and weight decay.
  const size_t pieces = std::min<size_t>(static_cast<size_t>(n), items.size());

  std::vector<size_t> starts;
  if (policy == SplitPolicy::Count) {
    // The seed's rule: ceil(count / n) tensors per piece.
    const size_t per = (items.size() + pieces - 1) / pieces;
    for (size_t i = 0; i < items.size(); i += per) starts.push_back(i);
  } else {
    // Smallest capacity for which a contiguous cut into `pieces` exists (binary search).
    int64_t lo = 0, hi = 0;
    for (const Item& it : items) lo = std::max(lo, it.bytes), hi += it.bytes;
    while (lo < hi) {
      int64_t mid = lo + (hi - lo) / 2;
      if (cut(items, pieces, mid).empty())
        lo = mid + 1;
      else
        hi = mid;
    }
    starts = cut(items, pieces, lo);
    if (starts.empty()) starts = cut(items, pieces, std::numeric_limits<int64_t>::max() / 2);
  }

  std::vector<std::vector<ParamGroup>> out;
  for (size_t s = 0; s < starts.size(); ++s) {
    const size_t end = s + 1 < starts.size() ? starts[s + 1] : items.size();
    std::vector<ParamGroup> piece;
    for (size_t i = starts[s]; i < end; ++i) {
      const ParamGroup& src = groups[items[i].group];
      if (i == starts[s] || items[i].group != items[i - 1].group) {
        piece.emplace_back();
        piece.back().lr = src.lr;
        piece.back().weight_decay = src.weight_decay;
      }
      piece.back().params.push_back(src.params[items[i].index]);
      piece.back().names.push_back(src.names.empty() ? "g" + std::to_string(items[i].group) + ".p" +
                                                           std::to_string(items[i].index)
                                                     : src.names[items[i].index]);
    }
    out.push_back(std::move(piece));
  }
  return out;
}

namespace {

// Data parallel: a group is averaged as one bucket (per wire type), whatever its size.
StepOptions one_bucket_per_group(StepOptions o) {
  o.bucket_bytes = std::numeric_limits<int64_t>::max();
  return o;
}

class OptimizerGroups final : public detail::HookedStep {
 public:
  OptimizerGroups(const std::vector<std::vector<ParamGroup>>& splits, const OptimizerFactory& make,
                  StepOptions options)
      : HookedStep(one_bucket_per_group(std::move(options))) {
    std::vector<at::Tensor> params;
    std::vector<std::string> names;
    for (size_t k = 0; k < splits.size(); ++k) {
      optimizers_.push_back(make(splits[k]));
      if (!optimizers_.back()) throw Error("optimizer groups: the factory returned no optimizer");
      detail::check_capabilities(*optimizers_.back(), "groups", options_);
      size_t size = 0;
      for (const ParamGroup& g : splits[k])
        for (size_t i = 0; i < g.params.size(); ++i, ++size) {
          params.push_back(g.params[i]);
          names.push_back(g.names[i]);
          group_of_.push_back(k);
        }
      starts_.push_back(params.size() - size);
      sizes_.push_back(size);
    }
    reset();
    attach(params, names, group_of_);
  }

  StepStats step() override {
    try {
      // A group some of whose parameters got no gradient still steps with those that did.
      for (size_t k = 0; k < optimizers_.size(); ++k)
        if (!done_[k] && processed_[k] > 0) step_group(k);
      sharding_.broadcast(params_);
    } catch (...) {
      abandon_iteration();  // a plugin failed: the next iteration starts clean
      reset();
      throw;
    }
    StepStats stats = finish_iteration();
    reset();
    return stats;
  }

  void backward(const at::Tensor& loss) override {
    refuse_second_backward();  // before the try: the pending iteration's counts must stay
    try {
      HookedStep::backward(loss);
    } catch (...) {
      reset();
      throw;
    }
  }

  const std::vector<std::shared_ptr<Optimizer>>& optimizers() const override { return optimizers_; }
  std::string name() const override { return "groups"; }

 protected:
  // Data parallel, a group is one bucket (per wire type): its averages come back together.
  void on_gradient(size_t i) override {
    const size_t k = group_of_[i];
    if (++processed_[k] == sizes_[k]) step_group(k);
  }

 private:
  void reset() {
    processed_.assign(optimizers_.size(), 0);
    done_.assign(optimizers_.size(), false);
  }
  void step_group(size_t k) {
    at::NoGradGuard no_grad;
    sharding_.drop_foreign_grads(params_, starts_[k], starts_[k] + sizes_[k]);
    optimizers_[k]->step();
    optimizers_[k]->zero_grad(true);
    done_[k] = true;
  }

  std::vector<std::shared_ptr<Optimizer>> optimizers_;
  std::vector<size_t> group_of_, starts_, sizes_;
  std::vector<size_t> processed_;  // per group, this iteration
  std::vector<bool> done_;
};

}  // namespace

std::unique_ptr<StepMode> make_optimizer_groups(const std::vector<ParamGroup>& groups, int64_t n,
                                                SplitPolicy policy, const OptimizerFactory& make,
                                                StepOptions options) {
  if (options.non_finite == NonFinitePolicy::Skip)
    throw Error(
        "optimizer groups cannot skip a step on non-finite gradients: earlier groups are "
        "already updated when a later gradient turns out non-finite; use the stop policy");
  if (detail::dynamic_scaling(options))
    throw Error(
        "optimizer groups cannot use a dynamic loss scale: it skips an iteration whose "
        "gradients overflowed, after seeing all of them, when earlier groups are already "
        "updated; use a fixed scale (an overflow is then a non-finite gradient)");
  size_t tensors = 0;
  for (const auto& g : groups) tensors += g.params.size();
  if (n >= 1 && static_cast<size_t>(n) > tensors && tensors > 0)
    detail::warner(options)(std::to_string(n) + " optimizer groups are more than the " +
                            std::to_string(tensors) + " trainable tensors; using " +
                            std::to_string(tensors) + " groups");
  auto splits = split_param_groups(groups, n, policy);
  return std::make_unique<OptimizerGroups>(splits, make, std::move(options));
}

}  // namespace fusebox
