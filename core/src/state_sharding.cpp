#include "state_sharding.h"

#include <ATen/ATen.h>

namespace fusebox {

std::vector<int> parameter_owners(const std::vector<ParamGroup>& groups, int world) {
  if (world < 1) throw Error("parameter_owners: world size must be at least 1");
  std::vector<int> owners;
  size_t tensors = 0;
  for (const auto& g : groups) tensors += g.params.size();
  if (tensors == 0) return owners;
  // The same contiguous, byte-balanced cut as optimizer groups; piece k belongs to rank k % world.
  const auto pieces = split_param_groups(groups, world, SplitPolicy::Size);
  for (size_t k = 0; k < pieces.size(); ++k)
    for (const auto& g : pieces[k])
      owners.insert(owners.end(), g.params.size(), static_cast<int>(k % world));
  return owners;
}

namespace detail {

StateSharding::StateSharding(const StepOptions& o, const std::vector<at::Tensor>& params) {
  if (!o.shard_optimizer_state || !o.comm || o.comm->world_size() < 2) return;
  comm_ = o.comm;
  ParamGroup all;
  all.params = params;
  owner_ = parameter_owners({all}, comm_->world_size());
}

void StateSharding::drop_foreign_grads(const std::vector<at::Tensor>& params, size_t first,
                                       size_t last) const {
  for (size_t i = first; i < last; ++i)
    if (!owns(i)) params[i].mutable_grad().reset();
}

void StateSharding::broadcast(const std::vector<at::Tensor>& params) const {
  if (!comm_) return;
  for (int r = 0; r < comm_->world_size(); ++r) {
    std::vector<at::Tensor> owned;
    for (size_t i = 0; i < params.size(); ++i)
      if (owner_[i] == r) owned.push_back(params[i]);
    broadcast_parameters(*comm_, owned, r);
  }
}

}  // namespace detail
}  // namespace fusebox
