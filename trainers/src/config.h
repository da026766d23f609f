// The resolved, typed configuration of one training run, and the checks that need no plugin.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "options.h"
#include "param_groups.h"

namespace fusebox::trainer {

/// Everything one run needs, with defaults applied and values checked.
struct TrainConfig {
  std::string name;  ///< run name ("" for a single run)

  // Optimizer plugin.
  std::optional<std::string> optimizer_plugin, optimizer;
  std::vector<std::string> plugin_dirs;
  bool allow_insecure_plugins = false;
  UserArgs optimizer_args;  ///< as given (config and command line merged)

  // Optimization.
  std::optional<double> learning_rate;
  std::string learning_rate_where;
  std::string lr_scheduler;
  double lr_scheduler_power = 1, lr_scheduler_num_cycles = 1;
  int64_t lr_warmup_steps = 0, max_train_steps = 1, train_batch_size = 1;
  /// --max-train-epochs (0: unset); when set, max_train_steps is worked out from it and from
  /// epoch_samples, the training samples of the --dataset tensors: file (set when the run is
  /// planned, with --max-train-epochs, --save-every-n-epochs or --eval-every-n-epochs).
  int64_t max_train_epochs = 0, epoch_samples = 0;
  int64_t gradient_accumulation_steps = 1;
  double max_grad_norm = 0;
  GroupRules param_group_rules;  ///< --lr-scale and --no-weight-decay
  double ema_decay = 0;          ///< --ema-decay (0: no average)
  bool fused_backward_pass = false;
  int64_t fused_optimizer_groups = 0;  ///< 0: not grouped
  std::string fused_optimizer_groups_split;
  std::string on_non_finite;  ///< "stop" or "skip"
  int64_t max_consecutive_skips =
      10;  ///< skip: fail after this many skipped steps in a row; 0 never

  // Precision and device.
  std::string mixed_precision, dtype, device;
  bool full_bf16 = false;
  bool memory_guard = true;  ///< --memory-guard on
  std::string loss_scale;    ///< "dynamic", "fixed" or "none" ("auto" resolved)
  double loss_scale_value = 65536;
  int64_t loss_scale_growth_interval = 2000;
  int64_t seed = 0, threads = 1, blas_threads = 0;

  // Distributed.
  int64_t nproc_per_node = 1;
  double dist_timeout = 300, dist_bucket_mb = 25;
  bool shard_optimizer_state = false;
  bool threads_given = false;       ///< --threads set explicitly (else ranks share the cores)
  bool blas_threads_given = false;  ///< --blas-threads set explicitly

  // Model and data.
  std::string model;
  int64_t model_width = 0, model_depth = 0, model_heads = 0, seq_len = 0, vocab_size = 0;
  int64_t image_size = 0;
  bool gradient_checkpointing = false;
  std::optional<std::string> model_script;
  std::optional<std::string> init_weights;  ///< --init-weights: the parameters to start from
  bool init_weights_strict = true;
  std::string dataset;                 ///< "synthetic", "none", "text" or "tensors"
  std::string dataset_path;            ///< for "text" and "tensors"
  std::string token_dtype = "uint16";  ///< a headerless .bin file's type (numpy's name)
  int64_t eval_every = 0;              ///< 0: none every N steps
  int64_t eval_every_n_epochs = 0;     ///< 0: none at epoch ends
  int64_t eval_batches = 4;
  std::string eval_dataset, eval_dataset_path;  ///< as dataset and dataset_path
  int64_t early_stop_patience = 0;              ///< 0: never stop early
  double eval_holdout = 0;  ///< text or tensors data: the file's last fraction, for evaluation only
  std::string eval_set_unused;  ///< an --eval-* option given without --eval-every (its label)

  // Output.
  std::string output_dir;
  int64_t log_every = 0, save_every_n_steps = 0, keep_last_n_checkpoints = 0;
  int64_t save_every_n_epochs = 0;  ///< 0: off
  std::optional<std::string> resume, save_model;
  bool save_best_eval = false;  ///< --save-model-at best
  /// --save-precision: the float type --save-model writes (unset: the one trained in).
  std::optional<c10::ScalarType> save_precision;
  std::string resolved_config;  ///< this run's settings as TOML (saved in checkpoints)

  /// "normal", "fused" or "groups".
  std::string mode() const;
  /// "run 'NAME': " before a message about one of several [[runs]], else "".
  std::string message_prefix() const;
  /// True when the run evaluates (--eval-every or --eval-every-n-epochs).
  bool evaluates() const { return eval_every > 0 || eval_every_n_epochs > 0; }
  /// True when `step` is the step in which the samples drawn pass a multiple of `every` epochs
  /// (of epoch_samples; false without them). Each step draws batch x accumulation samples of the
  /// training part (the whole global batch, data parallel too), so this depends on the step alone
  /// and holds across a resume.
  bool ends_epochs(int64_t step, int64_t every) const;
};

/// Refuses a file the trainer is to read that is missing, unreachable, a folder, not a regular
/// file (a pipe or device would block or never end) or unreadable: "LABEL: WHAT PATH ...", or
/// "WHAT PATH ..." without a label.
void check_readable_file(const std::string& label, const std::string& path, const char* what);

/// Builds and checks a run's config from fully merged settings (defaults at the bottom).
/// Throws Error naming the option and where it was set: bad values, forbidden combinations,
/// missing files.
TrainConfig resolve_config(const Layer& merged, const std::string& run_name);

}  // namespace fusebox::trainer
