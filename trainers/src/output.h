// What a run prints and writes: a progress bar on a terminal or periodic lines otherwise,
// per-step metrics as JSONL and CSV, a summary, and a side-by-side table of several runs.
// Files are written to a temporary name and renamed when complete, or removed on failure.
#pragma once

#include <cstdint>
#include <memory>
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
  double step_seconds = 0;
  int64_t peak_bytes = 0;  ///< peak tensor memory during this step
  std::string peak_phase;  ///< phase in which it happened
};

/// What a finished run reports.
struct RunSummary {
  std::string name, mode, optimizer;
  int64_t steps = 0;
  double wall_seconds = 0;
  double first_loss = 0, last_loss = 0;
  int64_t peak_bytes = 0;
  std::string peak_phase;
  int64_t parameters = 0;
  std::string memory_breakdown;  ///< analytic accounting next to the measured peak
  int64_t weights_bytes = 0, state_bytes = 0, grads_alive_bytes = 0;
};

/// JSON text of a summary.
std::string summary_json(const RunSummary& s);
/// Human-readable summary lines.
std::string summary_text(const RunSummary& s);
/// Side-by-side table of several runs.
std::string comparison_table(const std::vector<RunSummary>& runs);

/// Metrics records carried over from the run a resumed checkpoint belongs to.
struct MetricsHistory {
  std::string jsonl;     ///< metrics.jsonl lines of steps up to the resume point
  std::string csv_rows;  ///< metrics.csv rows of those steps (empty when the columns differ)
};

/// The records of steps 1..`step` in `folder`'s metrics files, where the run that wrote the
/// checkpoint being resumed kept them; CSV rows only when that file has the columns of
/// `num_groups` groups.
MetricsHistory read_metrics_history(const std::string& folder, int64_t step, size_t num_groups);

/// Per-step metrics files (metrics.jsonl, metrics.csv) in a folder; nothing when folder is "".
/// Records are kept in memory and the files rewritten whole (atomically) at each snapshot and at
/// the end, so they never hold half a line and always cover the newest checkpoint's steps.
class MetricsFiles {
 public:
  MetricsFiles(const std::string& folder, size_t num_groups, MetricsHistory history = {});
  void add(const StepMetrics& m);
  /// Writes metrics.jsonl and metrics.csv as they stand (before each checkpoint).
  void snapshot();
  /// Writes summary.json, then the metrics files.
  void commit(const RunSummary& s);

 private:
  std::string folder_, header_;
  std::string jsonl_, csv_;
  bool unwritten_ = true;  // records added since the files were last written
};

/// Progress on the console: a redrawn bar on a terminal, plain lines every `log_every` steps
/// otherwise.
class Progress {
 public:
  Progress(std::ostream& out, bool terminal, int64_t total_steps, int64_t log_every,
           std::string label);
  void update(const StepMetrics& m, double elapsed_seconds);
  /// Ends the bar's line (terminal only).
  void finish();

 private:
  std::ostream& out_;
  bool terminal_;
  int64_t total_, log_every_;
  std::string label_;
  bool drawn_ = false;
};

/// "1:05"-style duration.
std::string format_duration(double seconds);

}  // namespace fusebox::trainer
