// Training one configured run: model, data, plugin optimizer(s) in the chosen step mode,
// scheduler, precision, metrics.
#pragma once

#include <memory>
#include <ostream>

#include "config.h"
#include "fusebox/core/distributed.h"
#include "fusebox/core/plugin_registry.h"
#include "output.h"

namespace fusebox::trainer {

class DataSource;
class EvalData;

/// Where a run prints.
struct Console {
  std::ostream& out;  ///< progress, summaries, tables
  std::ostream& err;  ///< warnings and errors
  bool terminal;      ///< draw a progress bar instead of periodic lines
};

/// This process's place in a data-parallel job (world size 1 and no communicator: alone).
struct Distributed {
  DistributedConfig config;
  std::shared_ptr<Communicator> comm;
  bool leader() const { return config.rank == 0; }  ///< writes files and prints progress
};

/// A failure while training (after set-up succeeded): a plugin exception, non-finite gradients.
class TrainingFailed : public Error {
 public:
  using Error::Error;
};

/// --resume auto found the run finished (its checkpoint at --max-train-steps, or stopped early):
/// nothing to train, and not an error.
class AlreadyFinished : public Error {
 public:
  using Error::Error;
};

/// Checks what needs a plugin: capabilities against the mode, then the hyperparameters
/// (--learning-rate becomes lr; --full-bf16 turns on stochastic_rounding when the plugin has it).
HyperParams plugin_hyperparams(const TrainConfig& config, const LoadedPlugin& plugin);

/// Checks what needs the job's shape or LibTorch: a built-in model's parameters (one copy per
/// local rank) fit in the machine's memory, the batch splits over `world` ranks, the device
/// exists (on CUDA, a GPU for local rank `local_rank` of `local_ranks`); warns about precision
/// settings that cannot take effect.
void check_runtime(const TrainConfig& config, int world, int local_rank, int local_ranks,
                   std::ostream& warnings);

/// --list-params: the model's parameters (name, shape, values) with the lr and weight decay each
/// trains with under --lr-scale and --no-weight-decay. Builds the model on the CPU.
std::string list_params_text(const TrainConfig& config, const LoadedPlugin& plugin,
                             const HyperParams& hyperparams);

/// The data part of a run's first line: what the stream holds, the epochs' steps, and the
/// evaluation's batches, schedule and data (`eval_data` null: the run does not evaluate).
std::string data_text(const TrainConfig& config, const DataSource& data, const EvalData* eval_data);

/// --check-data: makes the run's training and evaluation data as training would, every value
/// checked (a file's NaN, a token id outside the vocabulary, a folder's mismatched files: the
/// error a run would stop with), and returns the data line. Builds a script model on the CPU for
/// its forward's arguments; a built-in model is not built.
std::string check_data_text(const TrainConfig& config);

/// Trains one run. Set-up problems throw Error; failures during training throw TrainingFailed.
RunSummary run_training(const TrainConfig& config, const LoadedPlugin& plugin,
                        const HyperParams& hyperparams, Console& console,
                        const Distributed& dist = {});

}  // namespace fusebox::trainer
