// What a run prints and writes: a progress bar on a terminal or periodic lines otherwise,
// per-step metrics as JSONL and CSV, a summary, and a side-by-side table of several runs.
// Files are written to a temporary name and renamed when complete, or removed on failure.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

namespace fusebox::trainer {

/// One optimizer step's measurements.
struct StepMetrics {
  int64_t step = 0;  ///< 1-based
  double loss = 0;
  std::vector<double> lrs;            ///< each group's lr for this step
  std::vector<double> effective_lrs;  ///< each group's applied step size
  double grad_norm = -1;              ///< -1: unknown
  double loss_scale = 0;              ///< the loss scale of this step; 0: no loss scaling
  double step_seconds = 0;
  int64_t peak_bytes = 0;           ///< peak tensor memory during this step
  std::string peak_phase;           ///< phase in which it happened
  std::optional<double> eval_loss;  ///< --eval-every: the held-out loss after this step
};

/// What a finished run reports.
struct RunSummary {
  std::string name, mode, optimizer;
  int64_t steps = 0;
  int64_t skipped_steps = 0;   ///< --on-non-finite skip: steps whose update was dropped
  int64_t overflow_steps = 0;  ///< dynamic loss scale: steps skipped because gradients overflowed
  double loss_scale = 0;       ///< the loss scale at the end; 0: no loss scaling
  double wall_seconds = 0;
  double first_loss = 0, last_loss = 0;
  int64_t peak_bytes = 0;
  std::string peak_phase;
  int64_t parameters = 0;
  std::string memory_breakdown;  ///< analytic accounting next to the measured peak
  int64_t weights_bytes = 0, state_bytes = 0, grads_alive_bytes = 0;
  std::optional<double> eval_loss;       ///< --eval-every: the last held-out loss
  std::optional<double> best_eval_loss;  ///< --eval-every: the lowest held-out loss so far
  int64_t best_eval_step = 0;            ///< the step best_eval_loss came after
  int64_t stopped_early_at = 0;  ///< --early-stop-patience: the step the run stopped after (0: not)
  int64_t early_stop_patience = 0;
};

/// The columns of a run's metrics files besides the fixed ones.
struct MetricsColumns {
  size_t num_groups = 1;    ///< lr_G and effective_lr_G for each optimizer group
  bool loss_scale = false;  ///< the run scales its loss: a loss_scale column
  bool eval_loss = false;   ///< --eval-every: an eval_loss column (empty between evaluations)
};

/// A loss scale in messages ("65536", "1.7e+38").
std::string scale_text(double scale);

/// JSON text of a summary.
std::string summary_json(const RunSummary& s);
/// Human-readable summary lines.
std::string summary_text(const RunSummary& s);
/// Side-by-side table of several runs.
std::string comparison_table(const std::vector<RunSummary>& runs);

/// Holds an output folder for one run: a lock (flock) on the folder that a second trainer writing
/// the same folder at the same time is refused by, instead of both interleaving metrics and
/// checkpoints. The lock goes with the process, however it ends; no file is left behind.
class OutputFolderLock {
 public:
  /// Creates the folder if needed; throws fusebox::Error naming the holder when it is taken.
  explicit OutputFolderLock(const std::string& folder);
  ~OutputFolderLock();
  OutputFolderLock(const OutputFolderLock&) = delete;
  OutputFolderLock& operator=(const OutputFolderLock&) = delete;

 private:
  int fd_ = -1;
};

/// Metrics records carried over from the run a resumed checkpoint belongs to.
struct MetricsHistory {
  std::string jsonl;     ///< metrics.jsonl lines of steps up to the resume point
  std::string csv_rows;  ///< metrics.csv rows of those steps (empty when the columns differ)
  bool csv_columns_differ = false;  ///< metrics.csv is there with other columns: rows left out
  /// The files do not hold steps 1..k of the checkpoint's run (another run wrote the folder
  /// since, or an earlier branch): nothing is carried over.
  bool not_the_checkpoints_run = false;
};

/// The records of steps 1..`step` in `folder`'s metrics files, where the run that wrote the
/// checkpoint being resumed kept them; CSV rows only when that file has `columns`. A last line
/// without its newline (a write cut short) is left out. The JSONL records must be steps
/// 1..`step` in order, the last one equal to `last_record` when that is given (what the
/// checkpoint saved), else nothing is carried over (MetricsHistory::not_the_checkpoints_run).
MetricsHistory read_metrics_history(const std::string& folder, int64_t step,
                                    const MetricsColumns& columns,
                                    const std::string* last_record = nullptr);

/// Per-step metrics files (metrics.jsonl, metrics.csv) in a folder; nothing when folder is "".
/// Records wait in memory until the next snapshot (before each checkpoint) or the end. The first
/// write replaces the folder's files with the history and those records, atomically; later ones
/// append only the new records, so each record is written once however long the run.
class MetricsFiles {
 public:
  MetricsFiles(const std::string& folder, const MetricsColumns& columns,
               MetricsHistory history = {});
  void add(const StepMetrics& m);
  /// Writes the records added since the last snapshot (before each checkpoint).
  void snapshot();
  /// Writes summary.json, then the metrics files.
  void commit(const RunSummary& s);
  /// Bytes of records not yet written (what the run holds in memory for the files).
  size_t pending_bytes() const { return jsonl_.size() + csv_.size(); }
  /// The newest record's JSONL line (without its newline): a checkpoint saves it, so that a
  /// resumed run can tell its own history from another run's.
  const std::string& last_record() const { return last_record_; }

 private:
  std::string folder_, header_;
  std::string jsonl_, csv_;  // records not yet in the files (at first, the history too)
  bool started_ = false;     // the files are this run's: append to them
  MetricsColumns columns_;
  std::string last_record_;
};

/// Progress on the console: a redrawn bar on a terminal, plain lines every `log_every` steps
/// otherwise. The rate counts the steps of this invocation: a resumed run starts after
/// `first_step`.
class Progress {
 public:
  Progress(std::ostream& out, bool terminal, int64_t total_steps, int64_t log_every,
           std::string label, int64_t first_step = 0);
  void update(const StepMetrics& m, double elapsed_seconds);
  /// Ends the bar's line (terminal only), at the end of a run or before a warning is printed
  /// mid-run; the next update() draws the bar anew on the next line.
  void finish();

 private:
  std::ostream& out_;
  bool terminal_;
  int64_t total_, log_every_, first_step_;
  std::string label_;
  bool drawn_ = false;
  std::optional<double> eval_loss_;  // the last evaluation's, shown from then on
};

/// "1:05"-style duration.
std::string format_duration(double seconds);

}  // namespace fusebox::trainer
