// Checkpoint saving and resuming in the run loop.
//
// Order on resume matters (a resumed fused run in the seed silently stopped learning because its
// hooks were attached before the state was restored): the checkpoint's parameters are copied into
// the model first, in place, and only then is the step mode built (its hooks attach to these very
// tensors); optimizer state, scheduler, RNG and data position follow.
#pragma once

#include <cstdint>
#include <optional>

#include "config.h"
#include "data.h"
#include "fusebox/core/checkpoint.h"
#include "fusebox/core/distributed.h"
#include "fusebox/core/ema.h"
#include "fusebox/core/loss_scaler.h"
#include "fusebox/core/lr_scheduler.h"
#include "fusebox/core/plugin_registry.h"
#include "fusebox/core/step_mode.h"
#include "model.h"

namespace fusebox::trainer {

/// Refuses inconsistent checkpoint options (called before any work starts).
void check_checkpoint_options(const TrainConfig& config);

/// The checkpoint file --resume names (a file, the one written last in a folder, or latest in
/// --output-dir); throws fusebox::Error when there is none, except with auto (the one written last
/// in --output-dir, if any), which gives nullopt then. `config.resume` must be set.
std::optional<std::filesystem::path> resume_checkpoint_path(const TrainConfig& config);

/// Loads the checkpoint named by --resume (a file; a folder, or "latest"/"auto" in --output-dir:
/// the checkpoint written last there) and checks it was written by the same plugin; nullopt
/// without --resume, or with auto and no checkpoint yet. `from`, when given, receives the path.
std::optional<Checkpoint> load_resume_checkpoint(const TrainConfig& config,
                                                 const LoadedPlugin& plugin,
                                                 std::string* from = nullptr);

/// Copies the checkpoint's parameters and buffers into `model` (names and shapes must match).
/// Returns false when the model has buffers but the checkpoint none (written before checkpoints
/// carried buffers): the model keeps its initial buffers.
bool restore_model(const Checkpoint& ckpt, Model& model);

/// ZeRO-1: the share of the optimizer state a rank keeps (see owned_optimizer_state()).
struct StateShare {
  std::vector<ParamGroup> groups;  ///< as given to the step mode
  int rank = 0, world = 1;
};

/// Restores optimizer state (only `share`'s part when given), scheduler, RNG and data position;
/// returns the steps already done.
int64_t restore_training_state(const Checkpoint& ckpt, StepMode& mode, LrScheduler& scheduler,
                               DataSource& data,
                               const std::optional<StateShare>& share = std::nullopt);

/// --ema-decay: restores the checkpoint's averages into `ema`; returns a warning when the
/// checkpoint has none (written without --ema-decay: the average starts from the resumed
/// parameters), else "". A malformed or foreign average throws Error.
std::string restore_ema(const Checkpoint& ckpt, ParameterEma& ema);

/// The lowest evaluation loss so far and the step it came after (--eval-every). Checkpoints keep
/// it, so a resumed run with --save-model-at best replaces the saved model only with a better
/// one, and --early-stop-patience stops it where it would have stopped the uninterrupted run.
struct BestEval {
  double loss = 0;
  int64_t step = 0;
  int64_t evals_since = 0;  ///< evaluations after it that did not beat it (--early-stop-patience)
};

/// The best evaluation a checkpoint saved; nullopt when it has none (a run without evaluations).
/// Throws Error when the entry is malformed.
std::optional<BestEval> restore_best_eval(const Checkpoint& ckpt);

/// Everything a checkpoint save needs from the run loop.
struct CheckpointContext {
  const TrainConfig& config;
  const LoadedPlugin& plugin;
  Model& model;
  StepMode& mode;
  LrScheduler& scheduler;
  DataSource& data;
  std::shared_ptr<Communicator> comm;  ///< data parallel, or null
  bool leader = true;                  ///< this rank writes the files
  bool sharded = false;                ///< ZeRO-1: the state is gathered from every rank first
  const int64_t* skipped_in_a_row = nullptr;  ///< saved as a counter when given
  const LossScaler* loss_scaler = nullptr;    ///< its scale and progress are saved when given
  const std::string* last_metrics_record = nullptr;    ///< saved when given (see MetricsFiles)
  const std::optional<BestEval>* best_eval = nullptr;  ///< saved when given and set
  const ParameterEma* ema = nullptr;                   ///< --ema-decay: saved when given
  /// The training data file's fingerprint (data_fingerprint()); saved when not empty.
  const std::string* data_fingerprint = nullptr;
  /// The evaluation's own file's (data_fingerprint(config, true)); saved when not empty.
  const std::string* eval_data_fingerprint = nullptr;
};

/// The fingerprint (fusebox::file_fingerprint's text) of the file --dataset trains on (text: or
/// tensors:; for a folder of tensors files, one over every file's name, size and hash), "" for
/// data made by the trainer (synthetic, none). With `evaluation`, that of the file
/// --eval-dataset names, "" when the run does not evaluate or evaluates on --dataset's file (its
/// held-out part, which --dataset's fingerprint covers). Throws Error naming the option when the
/// file cannot be read.
std::string data_fingerprint(const TrainConfig& config, bool evaluation = false);

/// When the checkpoint's run trained (`evaluation`: evaluated) on a file whose fingerprint differs
/// from `fingerprint` (this run's data_fingerprint()): a warning saying how (its size, or its
/// content) and what follows for this run; "" when they match, or when either has none (data
/// made by the trainer, or a checkpoint from before such fingerprints were saved).
std::string data_changed_since(const Checkpoint& ckpt, const TrainConfig& config,
                               const std::string& fingerprint, bool evaluation = false);

/// Continues `scaler` from the scale a checkpoint saved (a dynamic scale goes on where it was);
/// nothing when the checkpoint has none (written without loss scaling). A dynamic scale whose
/// checkpoint came from a fixed-scale run, or whose --loss-scale-value differs from that run's,
/// starts at the configured value instead: the returned text says so ("" when restored).
std::string restore_loss_scale(const Checkpoint& ckpt, LossScaler& scaler);

/// The settings of this run that differ from those of the run that wrote `ckpt` ("seed = 7 (was
/// 42), ..."), leaving out what is meant to change on resume (output, threads, step mode, world
/// size, device, more steps of a constant schedule); "" when none differ.
std::string settings_changed_since(const Checkpoint& ckpt, const TrainConfig& config);

/// True when a checkpoint is saved after `step` steps: every --save-every-n-steps, after the step
/// in which every --save-every-n-epochs-th epoch ends, and when `final`, if --output-dir is set.
bool checkpoint_due(const TrainConfig& config, int64_t step, bool final);

/// Saves a checkpoint after `step` steps when --save-every-n-steps says so or when `final`
/// (and --output-dir is set), then prunes per --keep-last-n-checkpoints. Data parallel: every
/// rank calls it; rank 0 writes one file, the same whatever the world size (with sharded state,
/// the other ranks first send it their shares).
void save_checkpoint_if_due(const CheckpointContext& ctx, int64_t step, bool final);

}  // namespace fusebox::trainer
