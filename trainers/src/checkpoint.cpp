#include "checkpoint.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <set>

#include "fusebox/core/distributed.h"
#include "fusebox/core/fingerprint.h"
#include "fusebox/core/messages.h"
#include "fusebox/error.h"
#include "output.h"
#include "tensor_data.h"
#include "toml_io.h"

namespace fusebox::trainer {

namespace fs = std::filesystem;

void check_checkpoint_options(const TrainConfig& c) {
  if (c.keep_last_n_checkpoints < 0)
    throw Error("--keep-last-n-checkpoints must be >= 0 (0 keeps all)");
  if (c.save_every_n_steps < 0)
    throw Error("--save-every-n-steps must be >= 0 (0: only at the end)");
}

std::optional<fs::path> resume_checkpoint_path(const TrainConfig& c) {
  fs::path path = *c.resume;
  std::error_code ec;
  const bool in_output_dir = *c.resume == "latest" || *c.resume == "auto";
  if (in_output_dir || fs::is_directory(path, ec)) {
    const fs::path dir = in_output_dir ? fs::path(c.output_dir) : path;
    const std::optional<fs::path> latest = latest_checkpoint(dir);
    if (!latest && *c.resume == "auto") return std::nullopt;  // the run's first start
    if (!latest) throw Error("--resume " + *c.resume + ": no checkpoint-*.fbx in " + dir.string());
    path = *latest;
  }
  return path;
}

std::optional<Checkpoint> load_resume_checkpoint(const TrainConfig& c, const LoadedPlugin& plugin,
                                                 std::string* from) {
  if (!c.resume) return std::nullopt;
  const std::optional<fs::path> found = resume_checkpoint_path(c);
  if (!found) return std::nullopt;
  const fs::path& path = *found;
  Checkpoint ckpt;
  try {
    ckpt = load_checkpoint(path);
  } catch (const Error& e) {
    throw Error(std::string("--resume: ") + e.what());
  }
  if (from) *from = path.string();
  const std::string saved_plugin = ckpt.meta.count("plugin") ? ckpt.meta.at("plugin") : "?";
  if (saved_plugin != plugin.info().name)
    throw Error("--resume: " + path.string() + " was written with optimizer plugin '" +
                saved_plugin + "', this run uses '" + plugin.info().name +
                "': resume with --optimizer " + saved_plugin);
  return ckpt;
}

bool restore_model(const Checkpoint& ckpt, Model& model) {
  try {
    restore_parameters(ckpt.model, model.parameters());
    const auto buffers = model.buffers();
    // Files written before checkpoints carried buffers have none: the model keeps its own.
    if (ckpt.buffers.empty()) return buffers.empty();
    restore_buffers(ckpt.buffers, buffers);
    return true;
  } catch (const Error& e) {
    throw Error(std::string("--resume: ") + e.what());
  }
}

int64_t restore_training_state(const Checkpoint& ckpt, StepMode& mode, LrScheduler& scheduler,
                               DataSource& data, const std::optional<StateShare>& share) {
  try {
    load_merged_optimizer_state(
        mode.optimizers(),
        share ? owned_optimizer_state(ckpt.optimizer, share->groups, share->rank, share->world)
              : ckpt.optimizer);
  } catch (const Error& e) {
    throw Error(std::string("--resume: ") + e.what());
  }
  // A file with a valid checksum may still come from another writer (or a future version).
  auto counter = [&](const char* name) {
    auto it = ckpt.counters.find(name);
    if (it == ckpt.counters.end() || it->second < 0)
      throw Error(std::string("--resume: the checkpoint has no valid '") + name +
                  "' counter: it was not written by fusebox's trainer");
    return it->second;
  };
  const int64_t step = counter("step"), scheduler_steps = counter("scheduler_steps");
  scheduler.set_step_count(scheduler_steps);
  try {
    restore_rng_state(ckpt.rng);
    if (auto it = ckpt.rng.find("data"); it != ckpt.rng.end())
      data.generator().set_state(it->second);
    // Written since tensors data walk through their file; an older checkpoint's run drew none.
    if (auto it = ckpt.counters.find("data_samples"); it != ckpt.counters.end()) {
      if (it->second < 0)
        throw Error(
            "--resume: the checkpoint has no valid 'data_samples' counter: it was not "
            "written by fusebox's trainer");
      data.set_samples_drawn(it->second);
    }
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error("--resume: the checkpoint's random generator state cannot be restored: " +
                first_line(e.what()));
  }
  return step;
}

namespace {

// A scale as text that reads back bit for bit.
std::string exact_text(double v) {
  char hex[64];
  std::snprintf(hex, sizeof hex, "%a", v);
  return hex;
}

}  // namespace

std::string settings_changed_since(const Checkpoint& ckpt, const TrainConfig& c) {
  auto it = ckpt.meta.find("config");
  if (it == ckpt.meta.end()) return "";
  // What may change on resume by design (output, threads, the step mode, the world, the device,
  // the number of steps with a constant schedule) or has its own message (the loss scale).
  static const std::set<std::string> free{"optimizer_plugin",
                                          "plugin_dir",
                                          "allow_insecure_plugins",
                                          "fused_backward_pass",
                                          "fused_optimizer_groups",
                                          "fused_optimizer_groups_split",
                                          "on_non_finite",
                                          "max_consecutive_skips",
                                          "loss_scale_value",
                                          "device",
                                          "threads",
                                          "blas_threads",
                                          "memory_guard",
                                          "gradient_checkpointing",
                                          "eval_every",
                                          "eval_every_n_epochs",
                                          "eval_batches",
                                          "eval_dataset",
                                          "early_stop_patience",
                                          "nproc_per_node",
                                          "dist_timeout",
                                          "dist_bucket_mb",
                                          "shard_optimizer_state",
                                          "model_script",
                                          "init_weights",
                                          "init_weights_strict",
                                          "output_dir",
                                          "log_every",
                                          "save_every_n_steps",
                                          "save_every_n_epochs",
                                          "keep_last_n_checkpoints",
                                          "resume",
                                          "save_model",
                                          "save_model_at",
                                          "save_precision"};
  const auto before = written_settings(it->second), now = written_settings(c.resolved_config);
  std::string out;
  int shown = 0, more = 0;
  auto note = [&](const std::string& key, const std::string& was, const std::string& is) {
    if (free.count(key) || (key == "max_train_steps" && c.lr_scheduler == "constant")) return;
    if (shown == 4) return void(++more);
    out += (shown++ ? ", " : "") + key + " = " + is + " (was " + was + ")";
  };
  for (const auto& [key, is] : now) {
    auto b = before.find(key);
    if (b == before.end())
      note(key, "unset", is);
    else if (b->second != is)
      note(key, b->second, is);
  }
  for (const auto& [key, was] : before)
    if (!now.count(key)) note(key, was, "unset");
  if (more) out += " and " + std::to_string(more) + " more";
  return out;
}

std::string restore_ema(const Checkpoint& ckpt, ParameterEma& ema) {
  if (ckpt.ema.empty())
    return "the checkpoint holds no parameter average (written without --ema-decay): the "
           "average starts from the resumed parameters, so it differs from an uninterrupted run's";
  const auto it = ckpt.counters.find("ema_updates");
  if (it == ckpt.counters.end() || it->second < 0)
    throw Error(
        "--resume: the checkpoint's parameter average has no valid update count: the "
        "checkpoint was not written by fusebox's trainer");
  try {
    ema.load(ckpt.ema, it->second);
  } catch (const Error& e) {
    throw Error(std::string("--resume: ") + e.what());
  }
  return "";
}

std::optional<BestEval> restore_best_eval(const Checkpoint& ckpt) {
  auto loss = ckpt.meta.find("best_eval_loss");
  auto step = ckpt.counters.find("best_eval_step");
  if (loss == ckpt.meta.end() && step == ckpt.counters.end()) return std::nullopt;
  const char* text = loss == ckpt.meta.end() ? "" : loss->second.c_str();
  char* end = nullptr;
  const double value = std::strtod(text, &end);
  if (end == text || *end != '\0' || !std::isfinite(value) || step == ckpt.counters.end() ||
      step->second < 1)
    throw Error("--resume: the saved best evaluation ('" + std::string(text) +
                "') is malformed: the checkpoint was not written by fusebox's trainer");
  auto since = ckpt.counters.find("best_eval_evals_since");
  return BestEval{value, step->second,
                  since == ckpt.counters.end() ? 0 : std::max<int64_t>(0, since->second)};
}

std::string restore_loss_scale(const Checkpoint& ckpt, LossScaler& scaler) {
  auto it = ckpt.meta.find("loss_scale");
  if (it == ckpt.meta.end()) return "";
  const char* text = it->second.c_str();
  char* end = nullptr;
  const double scale = std::strtod(text, &end);
  auto good = ckpt.counters.find("loss_scale_good_steps");
  if (end == text || *end != '\0' || good == ckpt.counters.end())
    throw Error("--resume: the saved loss scale '" + it->second +
                "' is not a number: the checkpoint was not written by fusebox's trainer");
  if (!scaler.dynamic()) return "";  // a fixed scale is the one configured now
  // A dynamic scale continues from the checkpoint unless this run asks for another start: the
  // checkpoint's run had a fixed scale, or --loss-scale-value changed (to reset a scale that a
  // stretch of overflows drove down, say). Checkpoints from before these keys continue as saved.
  const double start = scaler.options().scale;
  auto mode = ckpt.meta.find("loss_scale_mode");
  if (mode != ckpt.meta.end() && mode->second == "fixed")
    return "the checkpoint's run had a fixed loss scale (" + scale_text(scale) +
           "): the dynamic scale starts at --loss-scale-value " + scale_text(start);
  auto saved_start = ckpt.meta.find("loss_scale_start");
  if (saved_start != ckpt.meta.end() && saved_start->second != exact_text(start))
    return "--loss-scale-value " + scale_text(start) +
           " differs from the checkpoint's run: the dynamic scale starts at it, not at the "
           "checkpoint's " +
           scale_text(scale);
  try {
    scaler.restore(scale, good->second);
  } catch (const Error& e) {
    throw Error(std::string("--resume: ") + e.what() +
                ": the checkpoint was not written by fusebox's trainer");
  }
  return "";
}

std::string data_fingerprint(const TrainConfig& c, bool evaluation) {
  const std::string& dataset = evaluation ? c.eval_dataset : c.dataset;
  const std::string& path = evaluation ? c.eval_dataset_path : c.dataset_path;
  if (dataset != "text" && dataset != "tensors") return "";
  if (evaluation && (!c.evaluates() || (dataset == c.dataset && path == c.dataset_path))) return "";
  const std::string where = (evaluation ? "--eval-dataset " : "--dataset ") + dataset + ":" + path;
  const std::vector<std::string> files =
      dataset == "tensors" ? data_files(where, path) : std::vector<std::string>{path};
  try {
    if (files.size() == 1 && files.front() == path) return file_fingerprint(path).text();
    // A folder: every file's name, size and hash, in order, in one hash (and the sizes' sum).
    // The 64 blocks of one file are shared out among the files, so that a folder of many large
    // shards is not read 4 MiB a file at every start.
    const uint64_t blocks = 64 / files.size();
    FileFingerprint folder;
    folder.hash = fnv1a("", 0);
    for (const std::string& file : files) {
      const FileFingerprint one = file_fingerprint(file, blocks);
      const std::string name = fs::path(file).filename().string();
      folder.hash = fnv1a(name.data(), name.size() + 1, folder.hash);  // with its terminator
      folder.hash = fnv1a(&one.size, sizeof one.size, folder.hash);
      folder.hash = fnv1a(&one.hash, sizeof one.hash, folder.hash);
      folder.size += one.size, folder.sampled = folder.sampled || one.sampled;
    }
    return folder.text();
  } catch (const Error&) {
    throw Error(where + " cannot be read");
  }
}

std::string data_changed_since(const Checkpoint& ckpt, const TrainConfig& c,
                               const std::string& fingerprint, bool evaluation) {
  auto it = ckpt.meta.find(evaluation ? "eval_data_fingerprint" : "data_fingerprint");
  if (it == ckpt.meta.end() || fingerprint.empty() || it->second == fingerprint) return "";
  FileFingerprint was, is;
  const bool known =
      FileFingerprint::parse(it->second, was) && FileFingerprint::parse(fingerprint, is);
  const std::string how = !known || was.size == is.size
                              ? "the same size, other content"
                              : std::to_string(is.size) + " bytes, the checkpoint's run read " +
                                    std::to_string(was.size);
  if (evaluation)
    return "--eval-dataset " + c.eval_dataset + ":" + c.eval_dataset_path +
           " is not the file the checkpoint's run evaluated on (" + how +
           "): this run's evaluation losses do not compare with that run's" +
           (c.save_best_eval || c.early_stop_patience > 0
                ? ", nor with the best loss it kept (--save-model-at best, --early-stop-patience)"
                : "");
  return "--dataset " + c.dataset + ":" + c.dataset_path +
         " is not the file the checkpoint's run trained on (" + how +
         "): training goes on over this file's data, so it will not equal an uninterrupted run";
}

bool checkpoint_due(const TrainConfig& c, int64_t step, bool final) {
  if (c.output_dir.empty()) return false;
  return final || (c.save_every_n_steps > 0 && step % c.save_every_n_steps == 0) ||
         c.ends_epochs(step, c.save_every_n_epochs);
}

void save_checkpoint_if_due(const CheckpointContext& ctx, int64_t step, bool final) {
  const TrainConfig& c = ctx.config;
  if (!checkpoint_due(c, step, final)) return;
  // Every rank gets here at the same steps (the decision above is the same on all of them).
  const bool sharded = ctx.sharded && ctx.comm;
  if (!ctx.leader && !sharded) return;  // rank 0 holds every parameter's state and writes
  Checkpoint ckpt;
  // The optimizers' own tensors, not copies: the checkpoint is written before the next step.
  ckpt.optimizer = optimizer_state_now(ctx.mode.optimizers());
  if (sharded) {
    // Each rank holds the state of its parameters only: rank 0 gathers every share (the others
    // keep theirs alone, so sharding saves their memory also while a checkpoint is written).
    Checkpoint mine;
    mine.optimizer = std::move(ckpt.optimizer);
    const std::vector<std::string> parts = gather_bytes(*ctx.comm, encode_checkpoint(mine), 0);
    ckpt.optimizer.clear();
    if (!ctx.leader) return;
    for (size_t r = 0; r < parts.size(); ++r)
      for (auto& [k, t] :
           parse_checkpoint(parts[r], "state of rank " + std::to_string(r)).optimizer)
        ckpt.optimizer[k] = t;
  }
  if (!ctx.leader) return;
  const fs::path path = fs::path(c.output_dir) / checkpoint_name(step);
  std::error_code ec;
  for (const auto& [name, t] : ctx.model.parameters()) ckpt.model[name] = t;
  for (const auto& [name, t] : ctx.model.buffers()) ckpt.buffers[name] = t;
  ckpt.rng = capture_rng_state();
  ckpt.rng["data"] = ctx.data.generator().get_state();
  ckpt.counters["step"] = step;
  ckpt.counters["data_samples"] = ctx.data.samples_drawn();
  ckpt.counters["scheduler_steps"] = ctx.scheduler.step_count();
  if (ctx.skipped_in_a_row) ckpt.counters["skipped_in_a_row"] = *ctx.skipped_in_a_row;
  if (ctx.ema) {
    ckpt.ema = ctx.ema->averages();
    ckpt.counters["ema_updates"] = ctx.ema->updates();
  }
  if (ctx.last_metrics_record && !ctx.last_metrics_record->empty())
    ckpt.meta["last_metrics_record"] = *ctx.last_metrics_record;
  if (ctx.best_eval && *ctx.best_eval) {
    ckpt.meta["best_eval_loss"] = exact_text((*ctx.best_eval)->loss);
    ckpt.counters["best_eval_step"] = (*ctx.best_eval)->step;
    ckpt.counters["best_eval_evals_since"] = (*ctx.best_eval)->evals_since;
  }
  if (ctx.loss_scaler) {
    // Hexadecimal: the scale comes back bit for bit. The mode and configured start let a resumed
    // run tell a continued scale from one the user chose anew.
    ckpt.meta["loss_scale"] = exact_text(ctx.loss_scaler->scale());
    ckpt.meta["loss_scale_mode"] = ctx.loss_scaler->dynamic() ? "dynamic" : "fixed";
    ckpt.meta["loss_scale_start"] = exact_text(ctx.loss_scaler->options().scale);
    ckpt.counters["loss_scale_good_steps"] = ctx.loss_scaler->good_steps();
  }
  ckpt.meta["plugin"] = ctx.plugin.info().name;
  ckpt.meta["plugin_version"] = ctx.plugin.info().version;
  ckpt.meta["mode"] = ctx.mode.name();
  ckpt.meta["model"] = ctx.model.describe();
  ckpt.meta["config"] = c.resolved_config;
  if (ctx.data_fingerprint && !ctx.data_fingerprint->empty())
    ckpt.meta["data_fingerprint"] = *ctx.data_fingerprint;
  if (ctx.eval_data_fingerprint && !ctx.eval_data_fingerprint->empty())
    ckpt.meta["eval_data_fingerprint"] = *ctx.eval_data_fingerprint;
  fs::create_directories(c.output_dir, ec);
  save_checkpoint(ckpt, path);
  mark_latest_checkpoint(path);
  prune_checkpoints(c.output_dir, c.keep_last_n_checkpoints, step);
}

}  // namespace fusebox::trainer
