// Parameter groups from the command line: --lr-scale GLOB=F and --no-weight-decay GLOB give
// the parameters whose names match their own learning rate and weight decay (as torch.optim's
// param groups: biases and norms without decay, embeddings at a smaller lr); --freeze GLOB leaves
// parameters out of training altogether (no gradient, no optimizer state).
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "fusebox/optimizer.h"

namespace fusebox::trainer {

/// One --lr-scale entry: parameters whose names match `glob` train at lr × `factor`.
struct LrScaleRule {
  std::string glob;
  double factor = 1;
};

/// The rules, as parsed from the configuration.
struct GroupRules {
  std::vector<LrScaleRule> lr_scale;         ///< the first matching rule wins
  std::vector<std::string> no_weight_decay;  ///< globs: matching parameters get weight decay 0
  std::vector<std::string> freeze;           ///< globs: matching parameters are not trained
  std::string lr_scale_label, no_weight_decay_label, freeze_label;  ///< for messages

  bool empty() const { return lr_scale.empty() && no_weight_decay.empty() && freeze.empty(); }
};

/// Parses one --lr-scale entry "GLOB=F" (F a number >= 0); throws Error naming `label`.
LrScaleRule parse_lr_scale(const std::string& entry, const std::string& label);

/// True when `name` matches the shell-style `glob` (`*`, `?`, `[...]`; `*` also matches dots).
bool glob_matches(const std::string& glob, const std::string& name);

/// The parameter groups of a run, and one line on them for the run's header.
struct GroupedParams {
  std::vector<ParamGroup> groups;
  /// --freeze: the parameters left out of the groups (the caller switches their gradients off).
  std::vector<std::pair<std::string, at::Tensor>> frozen;
  /// "param groups: 2 (lr ×1, weight decay 0.01: 8 tensors, 12416 values; ...)"; empty without
  /// rules.
  std::string summary;
};

/// The parameters in groups, in the order of each group's first parameter; within a group in
/// model order. Without rules: one group with NaN lr and weight decay (the plugin's own). A group
/// whose factor is not 1 gets lr `base_lr` × factor (`base_lr` unset: Error, the plugin has no lr
/// to scale); a --no-weight-decay group gets weight decay 0. A glob that matches no parameter is
/// an Error naming it and some of the model's names; so is freezing every parameter.
/// `base_weight_decay` is for the summary.
GroupedParams make_param_groups(const std::vector<std::pair<std::string, at::Tensor>>& params,
                                const GroupRules& rules, std::optional<double> base_lr,
                                std::optional<double> base_weight_decay);

/// Where each parameter group's lr is read among a step mode's optimizers: the (optimizer, group)
/// holding the parameter group's first tensor. A grouped run splits a parameter group among
/// several optimizers whose parts share its lr, so metrics read one lr per parameter group and
/// have the same columns in every mode. Throws Error if a group's first tensor is in none.
std::vector<std::pair<size_t, size_t>> lr_sources(
    const std::vector<ParamGroup>& groups,
    const std::vector<std::shared_ptr<Optimizer>>& optimizers);

}  // namespace fusebox::trainer
