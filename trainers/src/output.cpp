#include "output.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <memory>
#include <sstream>

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "fusebox/core/checkpoint.h"
#include "fusebox/core/memory_tracker.h"
#include "fusebox/error.h"
#include "options.h"

namespace fusebox::trainer {

namespace fs = std::filesystem;

namespace {

std::string json_number(double v) {
  if (!std::isfinite(v)) return "null";
  return format_real(v);
}

std::string json_string(const std::string& s) {
  std::string o = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      o += '\\';
      o += static_cast<char>(c);
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      o += buf;
    } else {
      o += static_cast<char>(c);
    }
  }
  return o + "\"";
}

std::string json_array(const std::vector<double>& v) {
  std::string o = "[";
  for (size_t i = 0; i < v.size(); ++i) o += (i ? "," : "") + json_number(v[i]);
  return o + "]";
}

std::string short_number(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4g", v);
  return buf;
}

}  // namespace

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  const int64_t t = static_cast<int64_t>(std::llround(s));
  char buf[32];
  if (t >= 3600)
    std::snprintf(buf, sizeof buf, "%lld:%02lld:%02lld", static_cast<long long>(t / 3600),
                  static_cast<long long>(t / 60 % 60), static_cast<long long>(t % 60));
  else
    std::snprintf(buf, sizeof buf, "%lld:%02lld", static_cast<long long>(t / 60),
                  static_cast<long long>(t % 60));
  return buf;
}

std::string summary_json(const RunSummary& s) {
  std::ostringstream o;
  o << "{\"name\":" << json_string(s.name) << ",\"mode\":" << json_string(s.mode)
    << ",\"optimizer\":" << json_string(s.optimizer) << ",\"steps\":" << s.steps
    << ",\"skipped_steps\":" << s.skipped_steps;
  if (s.loss_scale > 0)
    o << ",\"overflow_steps\":" << s.overflow_steps
      << ",\"loss_scale\":" << json_number(s.loss_scale);
  o << ",\"wall_seconds\":" << json_number(s.wall_seconds)
    << ",\"first_loss\":" << json_number(s.first_loss)
    << ",\"last_loss\":" << json_number(s.last_loss) << ",\"peak_bytes\":" << s.peak_bytes
    << ",\"peak_phase\":" << json_string(s.peak_phase) << ",\"parameters\":" << s.parameters
    << ",\"weights_bytes\":" << s.weights_bytes << ",\"optimizer_state_bytes\":" << s.state_bytes
    << ",\"grads_alive_bytes\":" << s.grads_alive_bytes;
  if (s.eval_loss) o << ",\"eval_loss\":" << json_number(*s.eval_loss);
  if (s.best_eval_loss)
    o << ",\"best_eval_loss\":" << json_number(*s.best_eval_loss)
      << ",\"best_eval_step\":" << s.best_eval_step;
  if (s.stopped_early_at > 0) o << ",\"stopped_early_at\":" << s.stopped_early_at;
  o << "}\n";
  return o.str();
}

std::string summary_text(const RunSummary& s) {
  std::ostringstream o;
  o << (s.name.empty() ? std::string("run") : "run '" + s.name + "'") << " (" << s.mode << ", "
    << s.optimizer << "): " << s.steps << " steps in " << std::fixed << std::setprecision(2)
    << s.wall_seconds << " s; loss " << short_number(s.first_loss) << " -> "
    << short_number(s.last_loss);
  if (s.eval_loss) {
    o << " (eval " << short_number(*s.eval_loss);
    if (s.best_eval_loss && *s.best_eval_loss != *s.eval_loss)
      o << "; best " << short_number(*s.best_eval_loss) << " after step " << s.best_eval_step;
    o << ")";
  }
  o << "; peak tensor memory " << memory::format_bytes(s.peak_bytes);
  if (!s.peak_phase.empty()) o << " (during " << s.peak_phase << ")";
  if (s.skipped_steps > 0)
    o << "; " << s.skipped_steps << " step" << (s.skipped_steps == 1 ? "" : "s")
      << " skipped (non-finite)";
  if (s.overflow_steps > 0)
    o << "; " << s.overflow_steps << " step" << (s.overflow_steps == 1 ? "" : "s")
      << " skipped on gradient overflow (loss scale now " << short_number(s.loss_scale) << ")";
  if (s.stopped_early_at > 0)
    o << "; stopped early after step " << s.stopped_early_at << ": " << s.early_stop_patience
      << " evaluation" << (s.early_stop_patience == 1 ? "" : "s")
      << " in a row without a better loss";
  o << "\n";
  if (!s.memory_breakdown.empty()) o << "  memory: " << s.memory_breakdown << "\n";
  return o.str();
}

std::string comparison_table(const std::vector<RunSummary>& runs) {
  bool eval = false;
  for (const auto& r : runs) eval = eval || r.eval_loss.has_value();
  std::vector<std::vector<std::string>> rows = {
      {"run", "mode", "steps", "first loss", "last loss", "peak memory", "peak in", "time"}};
  if (eval) rows[0].insert(rows[0].begin() + 5, "eval loss");
  for (const auto& r : runs) {
    char t[32];
    std::snprintf(t, sizeof t, "%.1f s", r.wall_seconds);
    rows.push_back({r.name, r.mode, std::to_string(r.steps), short_number(r.first_loss),
                    short_number(r.last_loss), memory::format_bytes(r.peak_bytes), r.peak_phase,
                    t});
    if (eval)
      rows.back().insert(rows.back().begin() + 5, r.eval_loss ? short_number(*r.eval_loss) : "-");
  }
  std::vector<size_t> width(rows[0].size(), 0);
  for (const auto& row : rows)
    for (size_t i = 0; i < row.size(); ++i) width[i] = std::max(width[i], row[i].size());
  std::ostringstream o;
  for (size_t r = 0; r < rows.size(); ++r) {
    std::string line;
    for (size_t i = 0; i < rows[r].size(); ++i) {
      line += rows[r][i];
      if (i + 1 < rows[r].size()) line += std::string(width[i] - rows[r][i].size() + 2, ' ');
    }
    o << line << "\n";
    if (r == 0) {
      size_t total = 0;
      for (size_t w : width) total += w + 2;
      o << std::string(total - 2, '-') << "\n";
    }
  }
  return o.str();
}

namespace {

std::string csv_header(const MetricsColumns& c) {
  std::string h = "step,loss";
  for (size_t g = 0; g < c.num_groups; ++g) h += ",lr_" + std::to_string(g);
  for (size_t g = 0; g < c.num_groups; ++g) h += ",effective_lr_" + std::to_string(g);
  return h + ",grad_norm,step_seconds,peak_bytes,peak_phase" + (c.loss_scale ? ",loss_scale" : "") +
         (c.eval_loss ? ",eval_loss" : "");
}

// The step a record starts with ("{\"step\":12," or "12,"), or -1.
int64_t record_step(const std::string& line, const std::string& prefix) {
  if (line.compare(0, prefix.size(), prefix) != 0) return -1;
  int64_t step = 0;
  const char* begin = line.data() + prefix.size();
  const auto [end, ec] = std::from_chars(begin, line.data() + line.size(), step);
  return ec == std::errc() && end != begin ? step : -1;
}

// `*header_differs` (when given) is set when the file is there but starts with another header.
std::string records_up_to(const fs::path& file, int64_t step, const std::string& prefix,
                          const std::string* header, bool* header_differs = nullptr) {
  std::ifstream in(file, std::ios::binary);
  std::string line, out;
  if (!in) return out;
  if (header && (!std::getline(in, line) || line != *header)) {
    if (header_differs) *header_differs = !line.empty();
    return out;
  }
  while (std::getline(in, line)) {
    if (in.eof()) break;  // no newline: the end of a write cut short
    const int64_t s = record_step(line, prefix);
    if (s >= 1 && s <= step) out += line + "\n";
  }
  return out;
}

}  // namespace

OutputFolderLock::OutputFolderLock(const std::string& folder) {
  std::error_code ec;
  fs::create_directories(folder, ec);
  if (ec) throw Error("--output-dir: cannot create " + folder + ": " + ec.message());
  // The folder itself is locked: no lock file is left in it.
  fd_ = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd_ < 0) return;  // creating files will say what is wrong
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const bool taken = errno == EWOULDBLOCK;
    ::close(fd_);
    fd_ = -1;
    // A file system without flock (some network ones) keeps working unguarded.
    if (taken)
      throw Error("--output-dir: another trainer is writing " + folder +
                  " now; wait for it to finish or choose another --output-dir");
  }
}

OutputFolderLock::~OutputFolderLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the lock
}

std::string scale_text(double scale) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", scale);
  return buf;
}

MetricsHistory read_metrics_history(const std::string& folder, int64_t step,
                                    const MetricsColumns& columns, const std::string* last_record) {
  MetricsHistory h;
  const std::string header = csv_header(columns);
  h.jsonl = records_up_to(fs::path(folder) / "metrics.jsonl", step, "{\"step\":", nullptr);
  // Steps 1..step, each once and in order, ending with the checkpoint's own last record.
  std::istringstream in(h.jsonl);
  int64_t expected = 1;
  std::string line, last;
  bool ok = true;
  while (ok && std::getline(in, line)) {
    ok = record_step(line, "{\"step\":") == expected++;
    last = line;
  }
  ok = ok && expected == step + 1 && (!last_record || last == *last_record);
  if (!ok) {
    h.not_the_checkpoints_run = !h.jsonl.empty() || fs::exists(fs::path(folder) / "metrics.jsonl");
    h.jsonl.clear();
    return h;
  }
  h.csv_rows =
      records_up_to(fs::path(folder) / "metrics.csv", step, "", &header, &h.csv_columns_differ);
  return h;
}

MetricsFiles::MetricsFiles(const std::string& folder, const MetricsColumns& columns,
                           MetricsHistory history)
    : folder_(folder),
      header_(csv_header(columns) + "\n"),
      jsonl_(std::move(history.jsonl)),
      csv_(std::move(history.csv_rows)),
      columns_(columns) {
  if (folder_.empty()) return;
  std::error_code ec;
  fs::create_directories(folder_, ec);
  if (ec) throw Error("--output-dir: cannot create " + folder_ + ": " + ec.message());
}

void MetricsFiles::add(const StepMetrics& m) {
  if (folder_.empty()) return;
  std::ostringstream j;
  j << "{\"step\":" << m.step << ",\"loss\":" << json_number(m.loss)
    << ",\"lr\":" << json_array(m.lrs) << ",\"effective_lr\":" << json_array(m.effective_lrs)
    << ",\"grad_norm\":" << (m.grad_norm < 0 ? "null" : json_number(m.grad_norm))
    << ",\"step_seconds\":" << json_number(m.step_seconds) << ",\"peak_bytes\":" << m.peak_bytes
    << ",\"peak_phase\":" << json_string(m.peak_phase);
  if (columns_.loss_scale) j << ",\"loss_scale\":" << json_number(m.loss_scale);
  if (m.eval_loss) j << ",\"eval_loss\":" << json_number(*m.eval_loss);
  j << "}";
  last_record_ = j.str();
  jsonl_ += last_record_ + "\n";
  std::ostringstream c;
  c << m.step << "," << format_real(m.loss);
  for (double v : m.lrs) c << "," << format_real(v);
  for (double v : m.effective_lrs) c << "," << format_real(v);
  c << "," << (m.grad_norm < 0 ? "" : format_real(m.grad_norm)) << ","
    << format_real(m.step_seconds) << "," << m.peak_bytes << "," << m.peak_phase;
  if (columns_.loss_scale) c << "," << format_real(m.loss_scale);
  if (columns_.eval_loss) c << "," << (m.eval_loss ? format_real(*m.eval_loss) : "");
  c << "\n";
  csv_ += c.str();
}

void MetricsFiles::snapshot() {
  if (folder_.empty() || (started_ && jsonl_.empty()))
    return;  // the final step's were written before its checkpoint
  const fs::path jsonl = fs::path(folder_) / "metrics.jsonl",
                 csv = fs::path(folder_) / "metrics.csv";
  if (!started_) {
    // Replaces an earlier run's files in this folder, and the records a killed run wrote after
    // the checkpoint this run resumed from.
    fusebox::write_file_atomically(jsonl, jsonl_);
    fusebox::write_file_atomically(csv, header_ + csv_);
    started_ = true;
  } else {
    fusebox::append_to_file(jsonl, jsonl_);
    fusebox::append_to_file(csv, csv_);
  }
  jsonl_.clear();
  csv_.clear();
}

void MetricsFiles::commit(const RunSummary& s) {
  if (folder_.empty()) return;
  fusebox::write_file_atomically(fs::path(folder_) / "summary.json", summary_json(s));
  snapshot();
}

Progress::Progress(std::ostream& out, bool terminal, int64_t total_steps, int64_t log_every,
                   std::string label, int64_t first_step)
    : out_(out),
      terminal_(terminal),
      total_(total_steps),
      log_every_(log_every),
      first_step_(first_step),
      label_(std::move(label)) {}

void Progress::update(const StepMetrics& m, double elapsed) {
  const double rate = elapsed > 0 ? static_cast<double>(m.step - first_step_) / elapsed : 0;
  const double eta = rate > 0 ? static_cast<double>(total_ - m.step) / rate : 0;
  // The step size actually applied (Adafactor's relative step, auto-LR's d*lr), first group.
  const double lr =
      !m.effective_lrs.empty() ? m.effective_lrs.front() : (m.lrs.empty() ? 0 : m.lrs.front());
  char stats[256];
  // Four decimals, but no forty-digit line for a diverging loss.
  std::snprintf(stats, sizeof stats,
                std::abs(m.loss) < 1e6 ? "loss %.4f  lr %.3g  %.2f it/s  peak %s"
                                       : "loss %.4g  lr %.3g  %.2f it/s  peak %s",
                m.loss, lr, rate, memory::format_bytes(m.peak_bytes).c_str());
  if (m.eval_loss) eval_loss_ = m.eval_loss;
  std::string line = stats;
  if (eval_loss_) line += "  eval " + short_number(*eval_loss_);
  const std::string prefix = label_.empty() ? "" : label_ + " ";
  if (terminal_) {
    const int width = 24;
    const int filled = total_ > 0 ? static_cast<int>(width * m.step / total_) : width;
    out_ << "\r" << prefix << "[" << std::string(filled, '#') << std::string(width - filled, '.')
         << "] " << m.step << "/" << total_ << "  " << line << "  ETA " << format_duration(eta)
         << "   " << std::flush;
    drawn_ = true;
  } else if (log_every_ > 0 && (m.step % log_every_ == 0 || m.step == total_ ||
                                m.step == first_step_ + 1 || m.eval_loss)) {
    out_ << prefix << "step " << m.step << "/" << total_ << "  " << line << "  ETA "
         << format_duration(eta) << "\n"
         << std::flush;
  }
}

void Progress::finish() {
  if (terminal_ && drawn_) out_ << "\n" << std::flush;
  drawn_ = false;
}

}  // namespace fusebox::trainer
