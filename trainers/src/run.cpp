#include "run.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <map>
#include <regex>

#include "checkpoint.h"
#include "data.h"
#include "describe.h"
#include "fusebox/core/autocast.h"
#include "fusebox/core/checkpoint.h"
#include "fusebox/core/device.h"
#include "fusebox/core/ema.h"
#include "fusebox/core/host_resources.h"
#include "fusebox/core/loss_scaler.h"
#include "fusebox/core/lr_scheduler.h"
#include "fusebox/core/memory_accounting.h"
#include "fusebox/core/memory_tracker.h"
#include "fusebox/core/messages.h"
#include "fusebox/core/random_state.h"
#include "fusebox/core/step_mode.h"
#include "fusebox/core/threads.h"
#include "init_weights.h"
#include "interrupt.h"
#include "model.h"
#include "tensor_data.h"

namespace fusebox::trainer {

namespace fs = std::filesystem;

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

bool autocast_enabled(const TrainConfig& c) {
  if (c.mixed_precision == "bf16") return true;
  return c.mixed_precision == "fp16" && c.device == "cuda";
}

at::ScalarType autocast_dtype(const TrainConfig& c) {
  return c.mixed_precision == "fp16" ? at::kHalf : at::kBFloat16;
}

at::ScalarType param_dtype(const TrainConfig& c) {
  if (c.full_bf16) return at::kBFloat16;
  return c.dtype == "float64" ? at::kDouble : at::kFloat;
}

// Floating inputs take the parameters' dtype; targets and noise stay in the loss precision.
Batch to_device(Batch b, c10::Device device, at::ScalarType dtype, at::ScalarType loss_dtype) {
  auto move = [&](at::Tensor& t, at::ScalarType floating) {
    if (!t.defined()) return;
    t = t.is_floating_point() ? t.to(device, floating) : t.to(device);
  };
  move(b.input, dtype);
  move(b.target, loss_dtype);
  move(b.noise, loss_dtype);
  move(b.timesteps, loss_dtype);
  for (auto& [name, t] : b.arguments) move(t, dtype);
  return b;
}

// Rank `rank` of `world`'s rows of a global batch (each rank trains an equal share).
Batch shard(Batch b, int rank, int world) {
  if (world == 1) return b;
  auto rows = [&](at::Tensor& t) {
    if (!t.defined() || t.dim() == 0) return;
    const int64_t n = t.size(0) / world;
    t = t.narrow(0, rank * n, n);
  };
  rows(b.input);
  rows(b.target);
  rows(b.noise);
  rows(b.timesteps);
  for (auto& [name, t] : b.arguments) rows(t);
  return b;
}

// The mean of `value` over the ranks. `stop` rides along in the same reduction: in, whether this
// rank was asked to stop (a signal); out, whether any rank was, so all stop after the same step.
double mean_over_ranks(double value, const Distributed& dist, bool& stop) {
  if (!dist.comm) return value;
  at::Tensor t = at::empty({2}, at::kDouble);
  t[0] = value;
  t[1] = stop ? 1.0 : 0.0;
  if (auto p = dist.comm->sum(t)) p->wait();
  stop = t[1].item<double>() > 0;
  return t[0].item<double>() / dist.config.world_size;
}

std::string plugin_file(const LoadedPlugin& p) { return p.info().path.filename().string(); }

// --save-model's file: the model's parameters (in --save-precision), written atomically. A folder
// below --output-dir may not exist yet (the planning checked it can be made).
void write_model(Model& model, const std::string& path, std::optional<c10::ScalarType> as) {
  const std::filesystem::path folder = std::filesystem::path(path).parent_path();
  std::error_code ec;
  if (!folder.empty() && !std::filesystem::create_directories(folder, ec) && ec)
    throw Error("cannot create the folder " + folder.string() + " (" + ec.message() + ")");
  model.save(path, as);
}

// The evaluation of --eval-every: the mean loss of the held-out batches (each rank its share, as
// in training), in evaluation mode and without gradients, under the training's autocast. Nothing
// of the training changes: not the parameters, buffers, data stream or random generators.
double evaluate(Model& model, EvalData& data, const TrainConfig& c, const Distributed& dist,
                c10::Device device, at::ScalarType dtype, at::ScalarType loss_dtype) {
  KeepDefaultRng keep_rng(device);  // a script model's forward may draw from them
  at::NoGradGuard no_grad;
  model.set_training(false);
  struct BackToTraining {
    Model& m;
    ~BackToTraining() { m.set_training(true); }
  } back{model};
  data.rewind();
  if (c.eval_batches == 0) {
    // Every sample once: batch i of the pass goes whole to rank i % world (its last batch may be
    // smaller than a rank count could split), and each batch's loss, a mean over its samples,
    // counts by its samples.
    double loss_sum = 0, samples = 0;
    for (int64_t i = dist.config.rank; i < data.pass_batches(); i += dist.config.world_size) {
      const Batch batch = to_device(data.pass_batch(i), device, dtype, loss_dtype);
      AutocastGuard guard(autocast_enabled(c), device.type(), autocast_dtype(c));
      const int64_t n =
          batch.arguments.empty() ? batch.input.size(0) : batch.arguments.front().second.size(0);
      loss_sum += model.loss(batch).to(at::kDouble).item<double>() * static_cast<double>(n);
      samples += static_cast<double>(n);
    }
    if (!dist.comm) return loss_sum / samples;
    at::Tensor totals = at::tensor({loss_sum, samples}, at::kDouble);
    if (auto p = dist.comm->sum(totals)) p->wait();
    return totals[0].item<double>() / totals[1].item<double>();
  }
  double sum = 0;
  for (int64_t i = 0; i < c.eval_batches; ++i) {
    const Batch batch = to_device(shard(data.next(), dist.config.rank, dist.config.world_size),
                                  device, dtype, loss_dtype);
    AutocastGuard guard(autocast_enabled(c), device.type(), autocast_dtype(c));
    sum += model.loss(batch).to(at::kDouble).item<double>();
  }
  bool no_stop = false;
  return mean_over_ranks(sum / static_cast<double>(c.eval_batches), dist, no_stop);
}

// " every 50 steps", " every 2 epochs", " every 50 steps and every epoch".
std::string eval_schedule(const TrainConfig& c) {
  std::string out;
  if (c.eval_every > 0) out = " every " + std::to_string(c.eval_every) + " steps";
  if (c.eval_every_n_epochs > 0)
    out += std::string(out.empty() ? "" : " and") + " every " +
           (c.eval_every_n_epochs == 1 ? std::string("epoch")
                                       : std::to_string(c.eval_every_n_epochs) + " epochs");
  return out;
}

ModelOptions model_options(const TrainConfig& c) {
  ModelOptions mo;
  mo.kind = c.model, mo.width = c.model_width, mo.depth = c.model_depth;
  mo.heads = c.model_heads, mo.seq_len = c.seq_len, mo.image_size = c.image_size;
  mo.gradient_checkpointing = c.gradient_checkpointing;
  mo.vocab_size = c.dataset == "text" ? 256 : c.vocab_size;
  return mo;
}

// Who has the memory `m` counts: "this machine has", or "this process may use" under a cgroup.
std::string memory_owner(const host::MemoryLimit& m) {
  return m.cgroup_file.empty() ? "this machine has" : "this process may use";
}

// " (the cgroup limit in /sys/fs/cgroup/.../memory.max)" when a cgroup sets `m`, else "".
std::string memory_source(const host::MemoryLimit& m) {
  return m.cgroup_file.empty() ? "" : " (the cgroup limit in " + m.cgroup_file + ")";
}

// "--a", "--a or --b", "--a, --b or --c".
std::string either(const std::vector<std::string>& options) {
  std::string s;
  for (size_t i = 0; i < options.size(); ++i)
    s += (i == 0 ? "" : i + 1 == options.size() ? " or " : ", ") + options[i];
  return s;
}

// The options that size a built-in model's parameters.
std::vector<std::string> parameter_options(const TrainConfig& c) {
  std::vector<std::string> o{"--model-width", "--model-depth"};
  if (c.model == "transformer") {
    if (c.dataset != "text") o.push_back("--vocab-size");
    o.push_back("--seq-len");
  }
  return o;
}

// Refuses a size whose `bytes` per local rank do not fit in `memory` (the machine's, or a lower
// cgroup limit): "<head> need X<how>[ in each of the N ranks on this machine (Y in all)], more
// than the M of memory this machine has; lower <options>" (--nproc-per-node added with ranks).
void refuse_unless_fits(const host::MemoryLimit& memory, int local_ranks, const std::string& head,
                        double bytes, const std::string& how, std::vector<std::string> lower) {
  const double all = bytes * std::max(1, local_ranks);
  if (memory.bytes <= 0 || all <= static_cast<double>(memory.bytes)) return;
  std::string ranks;
  if (local_ranks > 1) {
    ranks = " in each of the " + std::to_string(local_ranks) + " ranks on this machine (" +
            memory::format_bytes(all) + " in all)";
    lower.push_back("--nproc-per-node");
  }
  throw Error(head + " need " + memory::format_bytes(bytes) + how + ranks + ", more than the " +
              memory::format_bytes(memory.bytes) + " of memory " + memory_owner(memory) +
              memory_source(memory) + "; lower " + either(lower));
}

// The built-in model's parameters must fit in the memory this process may use, or building it
// would fill the memory layer by layer until the kernel kills the process. Only the parameters
// are counted (gradients, optimizer state and activations come on top), so what is refused
// cannot train.
void check_model_fits(const TrainConfig& c, const host::MemoryLimit& memory, int local_ranks) {
  if (c.model_script || memory.bytes <= 0) return;
  const double count = builtin_parameter_count(model_options(c));
  // Built in float32, then converted: float32's bytes are needed even for bf16.
  const double element = c.dtype == "float64" ? 8 : 4;
  char n[32];
  std::snprintf(n, sizeof n, count < 1e9 ? "%.0f" : "%.3g", count);
  refuse_unless_fits(memory, local_ranks,
                     "cannot build the " + c.model + " model: its " + n + " parameters",
                     count * element,
                     c.full_bf16    ? " as it is built in float32 (before its conversion to bf16)"
                     : element == 8 ? " in float64"
                                    : " in float32",
                     parameter_options(c));
}

// The transformer's attention scores grow with the square of --seq-len: one block's scores for one
// micro-batch must exist at once, so a size whose scores alone cannot fit in host memory is refused
// before anything is built (else the first step fills memory for minutes before it fails). On CUDA
// the scores live in GPU memory, whose out-of-memory error comes at once.
void check_attention_fits(const TrainConfig& c, const host::MemoryLimit& memory, int world,
                          int local_ranks) {
  if (c.model_script || c.model != "transformer" || c.device != "cpu") return;
  const double element = c.dtype == "float64"                        ? 8
                         : c.mixed_precision == "no" && !c.full_bf16 ? 4
                                                                     : 2;
  const int64_t batch = c.train_batch_size / std::max(1, world);
  const double positions = static_cast<double>(c.seq_len) * static_cast<double>(c.seq_len);
  refuse_unless_fits(
      memory, local_ranks,
      "cannot train the transformer: one block's attention scores (" + std::to_string(batch) +
          " sequences x " + std::to_string(c.model_heads) + " heads x " +
          std::to_string(c.seq_len) + "^2)",
      static_cast<double>(batch) * static_cast<double>(c.model_heads) * positions * element, "",
      {"--train-batch-size", "--seq-len"});
}

// What the memory guard keeps free for the process's own memory beside its tensors (thread
// stacks, BLAS buffers, autograd's bookkeeping): 1/16 of the usable memory, at most 256 MiB.
int64_t guard_reserve() {
  const int64_t usable = host::usable_memory().bytes;
  return usable > 0 ? std::min<int64_t>(int64_t{256} << 20, usable / 16) : int64_t{256} << 20;
}

// When `what` is LibTorch's out-of-memory error (the CPU allocator's "can't allocate memory",
// CUDA's "out of memory"), one line: how much was asked for, how much memory there is, and the
// options that lower the need. Empty for any other error.
std::string out_of_memory_text(const std::string& what, const TrainConfig& c) {
  std::smatch m;
  std::string asked, where;
  if (std::regex_search(what, m,
                        std::regex(std::string(memory::kGuardRefusal) +
                                   "(\\d+) bytes: (\\d+) bytes are free \\(\\d+ kept in "
                                   "reserve\\) and this process's tensors hold (\\d+) bytes"))) {
    asked = memory::format_bytes(std::stod(m[1].str()));
    where = ", but only " + memory::format_bytes(std::stod(m[2].str())) +
            " of memory is free and the run's tensors hold " +
            memory::format_bytes(std::stod(m[3].str())) + " (--memory-guard)";
  } else if (std::regex_search(what, m,
                               std::regex("can't allocate memory: you tried to allocate (\\d+)"))) {
    asked = memory::format_bytes(std::stod(m[1].str()));
    if (const host::MemoryLimit memory = host::usable_memory(); memory.bytes > 0)
      where = ", and " + memory_owner(memory) + " " + memory::format_bytes(memory.bytes) +
              memory_source(memory);
  } else if (std::regex_search(
                 what, m, std::regex("out of memory\\. Tried to allocate ([0-9.]+ [KMGTP]?i?B)"))) {
    asked = m[1].str();
    where = " on the GPU";
  } else {
    return "";
  }
  std::vector<std::string> lower{"--train-batch-size"};
  if (!c.fused_backward_pass && c.fused_optimizer_groups == 0)
    lower[0] += " (a higher --gradient-accumulation-steps keeps the samples per step)";
  if (c.model_script) {
    if (c.dataset != "none") lower.push_back(c.dataset == "text" ? "--seq-len" : "--model-width");
    lower.push_back("the script model's own sizes");
  } else {
    if (c.model == "transformer") lower.push_back("--seq-len");
    if (c.model == "denoiser") lower.push_back("--image-size");
    for (const std::string& o : parameter_options(c))
      if (o != "--seq-len") lower.push_back(o);
  }
  // Recomputing blocks in backward frees their activations, which usually hold the most.
  const std::string recompute =
      !c.model_script && !c.gradient_checkpointing ? ", or use --gradient-checkpointing" : "";
  return "out of memory: it tried to allocate " + asked + " at once" + where + "; lower " +
         either(lower) + recompute;
}

}  // namespace

namespace {

// A real or integer hyperparameter that is set, else nothing.
std::optional<double> numeric_hyperparam(const HyperParams& hp, const std::string& key) {
  if (!hp.values().count(key) || !hp.is_set(key)) return std::nullopt;
  const Value& v = hp.value(key);
  if (std::holds_alternative<double>(v) || std::holds_alternative<int64_t>(v)) return hp.real(key);
  return std::nullopt;
}

// --lr-scale and --no-weight-decay need a plugin with that hyperparameter to vary per group.
void check_param_group_rules(const GroupRules& rules, const LoadedPlugin& plugin,
                             const HyperParams& hp) {
  const std::string& name = plugin.info().name;
  if (!rules.no_weight_decay.empty() && !numeric_hyperparam(hp, "weight_decay"))
    throw Error(rules.no_weight_decay_label + ": plugin " + name +
                " has no weight_decay hyperparameter, so there is no decay to switch off (see "
                "trainer --describe-plugin " +
                name + ")");
  bool scaled = false;
  for (const LrScaleRule& r : rules.lr_scale) {
    scaled = scaled || r.factor != 1;
    if (plugin.has(kAutoLr) && r.factor != 0 && r.factor != 1)
      throw Error(rules.lr_scale_label + ": '" + r.glob + "=" + format_real(r.factor) +
                  "': " + name +
                  " estimates one step size for all parameters, so a group trains at its lr or "
                  "not at all: the factor must be 1 or 0");
  }
  if (!scaled) return;
  const HyperParamSpec* relative = plugin.schema().find("relative_step");
  if (relative && relative->type == ParamType::Bool && hp.flag("relative_step"))
    throw Error(rules.lr_scale_label + ": " + name +
                " with relative_step=true computes its own step size and ignores the lr; pass "
                "--optimizer-args relative_step=false lr=VALUE to scale an lr");
  if (!numeric_hyperparam(hp, "lr"))
    throw Error(rules.lr_scale_label + ": scales the learning rate, but plugin " + name +
                " runs without one here (its lr is none or it has none); give --learning-rate "
                "or lr in --optimizer-args");
}

}  // namespace

HyperParams plugin_hyperparams(const TrainConfig& c, const LoadedPlugin& plugin) {
  const PluginInfo& info = plugin.info();
  if (c.fused_backward_pass && !plugin.has(kSupportsStepParam))
    throw Error(plugin_file(plugin) +
                " does not support --fused-backward-pass: it does not declare supports_step_param");
  if (c.fused_optimizer_groups > 0 && plugin.has(kAutoLr))
    throw Error("--fused-optimizer-groups cannot be used with " + info.name +
                ": auto-LR optimizers (such as D-Adaptation and Prodigy) estimate one step size "
                "from all parameters");
  if (c.shard_optimizer_state && plugin.has(kAutoLr))
    throw Error("--shard-optimizer-state cannot be used with " + info.name +
                ": auto-LR optimizers (such as D-Adaptation and Prodigy) estimate one step size "
                "from all parameters, which no rank holds alone");
  UserArgs args = c.optimizer_args;
  if (c.learning_rate) {
    if (!plugin.schema().find("lr"))
      throw Error(c.learning_rate_where + ": plugin " + info.name +
                  " has no lr hyperparameter (see trainer --describe-plugin " + info.name + ")");
    UserArg a;
    a.value = *c.learning_rate;
    a.where = c.learning_rate_where;
    args["lr"] = a;
  }
  if (c.full_bf16 && plugin.schema().find("stochastic_rounding") &&
      !args.count("stochastic_rounding")) {
    UserArg a;
    a.value = true;
    a.where = "--full-bf16";
    args["stochastic_rounding"] = a;
  }
  HyperParams hp = plugin.validate(args);
  // Adafactor's relative step replaces lr: a schedule of lr would be silently ignored.
  const HyperParamSpec* relative = plugin.schema().find("relative_step");
  if (relative && relative->type == ParamType::Bool && hp.flag("relative_step") &&
      c.lr_scheduler != "constant" && c.lr_scheduler != "adafactor")
    throw Error("--lr-scheduler " + c.lr_scheduler + ": " + info.name +
                " with relative_step=true computes its own step size and would ignore the "
                "schedule; pass --optimizer-args relative_step=false lr=VALUE to schedule an lr, "
                "or leave --lr-scheduler constant");
  check_param_group_rules(c.param_group_rules, plugin, hp);
  return hp;
}

std::string data_text(const TrainConfig& c, const DataSource& data, const EvalData* eval_data) {
  std::string text = data.describe();
  if (c.max_train_epochs > 0)
    text += "; " + std::to_string(c.max_train_epochs) + " epoch" +
            (c.max_train_epochs == 1 ? "" : "s") + " of " + std::to_string(c.epoch_samples) +
            " samples: " + std::to_string(c.max_train_steps) + " steps";
  if (!eval_data) return text;
  const int64_t batches = c.eval_batches == 0 ? eval_data->pass_batches() : c.eval_batches;
  const std::string counted = std::to_string(batches) + (batches == 1 ? " batch" : " batches");
  const std::string every = c.eval_dataset == "text" ? "every window (" : "every sample (";
  return text + "; eval: " + (c.eval_batches == 0 ? every + counted + ")" : counted) +
         eval_schedule(c) +
         (c.eval_dataset == "text" || c.eval_dataset == "tensors" ? " from " + eval_data->describe()
                                                                  : "");
}

std::string check_data_text(const TrainConfig& c) {
  std::vector<ForwardArgument> forward;  // what a script's forward takes; built-in models: none
  if (c.model_script)
    forward = load_script_model(*c.model_script, c10::Device(c10::kCPU), param_dtype(c))
                  ->forward_arguments();
  const std::unique_ptr<DataSource> data = make_data(c, forward);
  std::unique_ptr<EvalData> eval_data;
  if (c.evaluates()) eval_data = std::make_unique<EvalData>(c, forward);
  // The data line, and what was checked beyond it.
  const ArchiveCheck archives = check_archive_crcs(c);
  std::string checked;
  if (archives.entries > 0)
    checked += "; CRC-32s of " + std::to_string(archives.entries) + " archive entr" +
               (archives.entries == 1 ? "y" : "ies") + " checked";
  if (archives.unchecked_archives > 0)
    checked += "; the CRC-32s of " + std::to_string(archives.unchecked_archives) + " archive" +
               (archives.unchecked_archives == 1 ? " were" : "s were") +
               " not checked (this fusebox was built without zlib)";
  return (c.name.empty() ? "" : "[" + c.name + "] ") +
         "data: " + data_text(c, *data, eval_data.get()) + checked + "\n";
}

std::string list_params_text(const TrainConfig& c, const LoadedPlugin& plugin,
                             const HyperParams& hp) {
  check_model_fits(c, host::usable_memory(), 1);
  at::manual_seed(static_cast<uint64_t>(c.seed));
  std::unique_ptr<Model> model;
  if (c.model_script) {
    model = load_script_model(*c.model_script, c10::Device(c10::kCPU), param_dtype(c));
  } else {
    ModelOptions mo = model_options(c);
    mo.dtype = param_dtype(c);
    model = make_builtin_model(mo);
  }
  const std::optional<double> lr = numeric_hyperparam(hp, "lr");
  const std::optional<double> wd = numeric_hyperparam(hp, "weight_decay");
  const GroupedParams grouped = make_param_groups(model->parameters(), c.param_group_rules, lr, wd);
  std::vector<std::vector<std::string>> rows = {
      {"NAME", "SHAPE", "VALUES", "GROUP", "LR", "WEIGHT DECAY"}};
  for (size_t g = 0; g < grouped.groups.size(); ++g) {
    const ParamGroup& group = grouped.groups[g];
    const std::string group_lr = !std::isnan(group.lr) ? format_real(group.lr)
                                 : lr                  ? format_real(*lr)
                                                       : "-";
    const std::string group_wd = !std::isnan(group.weight_decay) ? format_real(group.weight_decay)
                                 : wd                            ? format_real(*wd)
                                                                 : "-";
    for (size_t i = 0; i < group.params.size(); ++i) {
      rows.push_back({group.names[i], c10::str(group.params[i].sizes()),
                      std::to_string(group.params[i].numel()), std::to_string(g), group_lr,
                      group_wd});
    }
  }
  for (const auto& [name, t] : grouped.frozen)
    rows.push_back({name, c10::str(t.sizes()), std::to_string(t.numel()), "frozen", "-", "-"});
  // Model order, as the model names them (groups only gather them).
  std::map<std::string, size_t> row_of;
  for (size_t r = 1; r < rows.size(); ++r) row_of[rows[r][0]] = r;
  std::vector<std::vector<std::string>> ordered = {rows.front()};
  for (const auto& [name, t] : model->parameters()) ordered.push_back(rows[row_of.at(name)]);
  return "parameters of " + model->describe() + " with " + plugin.info().name + " (" +
         std::to_string(grouped.groups.size()) + " param group" +
         (grouped.groups.size() == 1 ? "" : "s") + "; lr before any schedule):\n" +
         table(ordered, "  ");
}

void check_runtime(const TrainConfig& c, int world, int local_rank, int local_ranks,
                   std::ostream& warnings) {
  const host::MemoryLimit memory = host::usable_memory();
  check_model_fits(c, memory, local_ranks);
  check_attention_fits(c, memory, world, local_ranks);
  if (world > 1 && c.train_batch_size % world != 0)
    throw Error("--train-batch-size " + std::to_string(c.train_batch_size) +
                " cannot be split evenly over " + std::to_string(world) +
                " ranks: each rank trains an equal share of every batch; use a multiple of " +
                std::to_string(world));
  if (world > 1 && c.dataset == "none")
    throw Error(
        "--dataset none: a script model that makes its own data cannot be split over "
        "ranks; give it synthetic or text data");
  if (c.device == "cuda") gpu_for_local_rank(local_rank, local_ranks, visible_gpus());
  if (c.mixed_precision == "fp16" && c.device == "cpu")
    warnings << "trainer: warning: --mixed-precision fp16: fp16 autocast is CUDA only here "
                "(LibTorch 1.13 has none on the CPU); training in float32"
             << (c.loss_scale == "none" ? "" : ", with the loss scale")
             << ", without autocast (use bf16 on CPU)\n";
  if (c.mixed_precision == "fp16" && c.loss_scale == "none")
    warnings << "trainer: warning: --mixed-precision fp16 with --loss-scale none: small "
                "gradients may underflow to zero (bf16 avoids this)\n";
  if (!c.eval_set_unused.empty())
    warnings << "trainer: warning: " << c.message_prefix() << c.eval_set_unused
             << " has no effect without --eval-every N (how often to evaluate)\n";
  // A warm-up that does nothing, or never ends, is a setting mistake the run would not show
  // until its learning rates were read afterwards.
  const std::string in_run = c.message_prefix();
  const std::string warmup = "--lr-warmup-steps " + std::to_string(c.lr_warmup_steps);
  if (c.lr_warmup_steps > 0 && (c.lr_scheduler == "constant" || c.lr_scheduler == "adafactor"))
    warnings << ("trainer: warning: " + in_run + warmup + " has no effect with --lr-scheduler " +
                 c.lr_scheduler + ", which holds the learning rate from the first step" +
                 (c.lr_scheduler == "constant" ? "; use constant_with_warmup to warm up" : "") +
                 "\n");
  else if (c.lr_warmup_steps > 0 && c.lr_warmup_steps >= c.max_train_steps)
    warnings << ("trainer: warning: " + in_run + warmup + " is not below --max-train-steps " +
                 std::to_string(c.max_train_steps) +
                 ": the learning rate never reaches its set value\n");
}

RunSummary run_training(const TrainConfig& c, const LoadedPlugin& plugin, const HyperParams& hp,
                        Console& con, const Distributed& dist) {
  // ---- set-up: errors here are configuration problems
  const int world = dist.config.world_size;
  // The start of a failure's message: which run failed (with several [[runs]]).
  const std::string failed_in = c.message_prefix();
  if (c.shard_optimizer_state && world == 1)
    con.err << "trainer: warning: --shard-optimizer-state has no effect in a single process\n";
  // Ranks on one machine share its cores unless --threads / --blas-threads say otherwise.
  const int64_t local_ranks = std::max(1, dist.config.local_world_size);
  int64_t threads = c.threads, blas_threads = c.blas_threads;
  if (!c.threads_given) threads = std::max<int64_t>(1, threads / local_ranks);
  // OpenBLAS sizes its own pool (an OpenMP build follows --threads), but knows no cgroup quota:
  // its count is lowered to the usable cores, never raised (Debian 13's OpenBLAS gives NaN bf16
  // products with more threads than the intra-op pool, which its OpenMP build never starts).
  if (!c.blas_threads_given && local_ranks > 1)
    blas_threads = std::max<int64_t>(1, available_cores() / local_ranks);
  else if (!c.blas_threads_given && blas_threads_now() > available_cores())
    blas_threads = available_cores();
  const ComputeThreads used =
      set_compute_threads(static_cast<int>(threads), static_cast<int>(blas_threads));
  at::manual_seed(static_cast<uint64_t>(c.seed));
  memory::mark_phase("setup");
  // Running out of host memory ends the run with a message, not by the kernel's OOM killer.
  if (c.memory_guard)
    memory::set_cpu_guard([] { return host::available_memory(); }, guard_reserve());
  else
    memory::set_cpu_guard({}, 0);
  const c10::Device device =
      select_device({c.device, dist.config.local_rank, dist.config.local_world_size});
  const at::ScalarType dtype = param_dtype(c);
  const at::ScalarType loss_dtype = c.dtype == "float64" ? at::kDouble : at::kFloat;

  std::unique_ptr<Model> model;
  std::unique_ptr<DataSource> data;
  std::unique_ptr<EvalData> eval_data;
  try {
    if (c.model_script) {
      model = load_script_model(*c.model_script, device, dtype);
    } else {
      ModelOptions mo = model_options(c);
      mo.device = device, mo.dtype = dtype;
      model = make_builtin_model(mo);
    }
    const std::vector<ForwardArgument> forward = model->forward_arguments();
    data = make_data(c, forward);
    if (c.evaluates()) eval_data = std::make_unique<EvalData>(c, forward);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    const std::string what = c.model_script ? std::string("script model") : c.model;
    if (const std::string oom = out_of_memory_text(e.what(), c); !oom.empty())
      throw Error("cannot build the " + what + " model and its data: " + oom);
    // Sizes the machine cannot hold (out of memory, a size overflowing LibTorch's arithmetic).
    throw Error("cannot build the " + what + " model and its data: " + first_line(e.what()) +
                " (sizes this machine cannot hold? see --model-width, --model-depth, --seq-len, "
                "--vocab-size, --image-size, --train-batch-size)");
  }
  // Parameters are restored before the step mode exists, so its hooks see the resumed tensors.
  std::string resumed_from;
  // Released once restored (below): its tensors are a second copy of the weights and state.
  std::optional<Checkpoint> resumed = load_resume_checkpoint(c, plugin, &resumed_from);
  // Said once the checkpoint has passed every check below: a checkpoint that is refused gets its
  // one error line, not warnings about how it would have been used.
  std::vector<std::string> resume_warnings;
  if (resumed)
    if (const std::string changed = settings_changed_since(*resumed, c); !changed.empty())
      resume_warnings.push_back("settings differ from the run that wrote " + resumed_from + ": " +
                                changed +
                                "; this run goes on with its own settings, so it will not equal "
                                "an uninterrupted run");
  // The data file is fingerprinted (4 MiB read at most) so that a resumed run knows whether it
  // goes on over the data the checkpoint's run trained on (rank 0 writes and resumes the files).
  const bool prints = dist.leader() && (resumed || !c.output_dir.empty());
  const std::string data_print = prints ? data_fingerprint(c) : "";
  const std::string eval_data_print = prints ? data_fingerprint(c, true) : "";
  if (resumed)
    for (const bool evaluation : {false, true})
      if (const std::string changed = data_changed_since(
              *resumed, c, evaluation ? eval_data_print : data_print, evaluation);
          !changed.empty())
        resume_warnings.push_back(changed);
  if (resumed && resumed->meta.count("plugin_version") &&
      resumed->meta.at("plugin_version") != plugin.info().version)
    resume_warnings.push_back(resumed_from + " was written by " + plugin.info().name + " " +
                              resumed->meta.at("plugin_version") + ", this is " +
                              plugin.info().version +
                              ": its optimizer state is loaded as is (if the plugin's state "
                              "changed between the versions, resume with the version that "
                              "wrote it)");
  if (resumed && !restore_model(*resumed, *model))
    resume_warnings.push_back(resumed_from +
                              " holds no model buffers (written by an older fusebox): the model "
                              "keeps its initial buffers, so the result differs from an "
                              "uninterrupted run");
  // --init-weights: a fresh run starts from the file's parameters (a resumed one from the
  // checkpoint's, which already hold them trained on).
  std::string initial_weights;
  if (c.init_weights && !resumed)
    initial_weights = load_initial_weights(*c.init_weights, *model, c.init_weights_strict);
  const GroupedParams grouped =
      make_param_groups(model->parameters(), c.param_group_rules, numeric_hyperparam(hp, "lr"),
                        numeric_hyperparam(hp, "weight_decay"));
  std::vector<ParamGroup> groups = grouped.groups;
  // --freeze: autograd computes no gradient for these, and no optimizer holds them.
  for (const auto& [name, t] : grouped.frozen) t.requires_grad_(false);
  if (dist.comm) {
    // Every rank starts from rank 0's weights (whatever the model's own initialisation did).
    std::vector<at::Tensor> params;  // trained and frozen ones
    for (const auto& [name, t] : model->parameters()) params.push_back(t);
    broadcast_parameters(*dist.comm, params, 0);
  }
  // A model's buffers (running statistics that forward updates) follow rank 0's, broadcast before
  // every forward as PyTorch's DistributedDataParallel does: the ranks stay alike, and a resumed
  // run (whose checkpoint holds rank 0's buffers) continues exactly.
  // They are looked up before each forward: a script that assigns a new tensor to a buffer
  // (self.running = ...) replaces the one a list made once would hold.
  const bool share_buffers = dist.comm && !model->buffers().empty();

  StepOptions so;
  so.max_grad_norm = c.max_grad_norm;
  so.non_finite = c.on_non_finite == "skip" ? NonFinitePolicy::Skip : NonFinitePolicy::Stop;
  // One write per line: the ranks of a data-parallel job share stderr. The step modes' warnings
  // (a parameter without a gradient on any rank) are the same on every rank: rank 0 says them.
  // A warning during training first ends the progress bar's line, or it would be appended to the
  // bar on a terminal (the bar is drawn once `progress` exists, below).
  std::function<void()> end_bar_line = [] {};
  so.warn = [&con, &end_bar_line, leader = dist.leader()](const std::string& m) {
    if (!leader) return;
    end_bar_line();
    con.err << ("trainer: warning: " + m + "\n") << std::flush;
  };
  so.comm = dist.comm;
  so.bucket_bytes = static_cast<int64_t>(c.dist_bucket_mb * 1024 * 1024);
  so.shard_optimizer_state = c.shard_optimizer_state && dist.comm;
  if (c.loss_scale != "none") {
    LossScaleOptions ls;
    ls.scale = c.loss_scale_value;
    ls.dynamic = c.loss_scale == "dynamic";
    ls.growth_interval = c.loss_scale_growth_interval;
    so.loss_scaler = std::make_shared<LossScaler>(ls);
  }
  const ModeChoice choice{
      c.mode(), c.fused_optimizer_groups,
      c.fused_optimizer_groups_split == "count" ? SplitPolicy::Count : SplitPolicy::Size};
  std::unique_ptr<StepMode> mode = make_step_mode(
      choice, groups, [&](std::vector<ParamGroup> g) { return plugin.create(std::move(g), hp); },
      so);
  SchedulerOptions sched;
  sched.type = c.lr_scheduler;
  sched.warmup_steps = c.lr_warmup_steps;
  sched.total_steps = c.max_train_steps;
  sched.num_cycles = c.lr_scheduler_num_cycles;
  sched.power = c.lr_scheduler_power;
  LrScheduler scheduler(mode->optimizers(), sched);
  std::optional<StateShare> share;  // ZeRO-1: the optimizer state this rank keeps
  if (so.shard_optimizer_state) share = StateShare{groups, dist.config.rank, world};
  const int64_t first_step =
      resumed ? restore_training_state(*resumed, *mode, scheduler, *data, share) : 0;
  if (resumed && so.loss_scaler)
    if (const std::string note = restore_loss_scale(*resumed, *so.loss_scaler); !note.empty())
      resume_warnings.push_back(note);
  // --ema-decay: the average starts from the (resumed) parameters or continues the checkpoint's.
  std::optional<ParameterEma> ema;
  if (c.ema_decay > 0) {
    std::vector<std::pair<std::string, at::Tensor>> trained;  // a frozen one's average is itself
    for (const ParamGroup& g : groups)
      for (size_t i = 0; i < g.params.size(); ++i) trained.emplace_back(g.names[i], g.params[i]);
    ema.emplace(std::move(trained), c.ema_decay);
    if (resumed)
      if (const std::string note = restore_ema(*resumed, *ema); !note.empty())
        resume_warnings.push_back(note);
  }
  if (first_step >= c.max_train_steps && *c.resume == "auto")
    throw AlreadyFinished(resumed_from + " is at step " + std::to_string(first_step) +
                          " of --max-train-steps " + std::to_string(c.max_train_steps) +
                          ": the run is finished, nothing to do");
  if (first_step >= c.max_train_steps)
    throw Error("--resume: the checkpoint is at step " + std::to_string(first_step) +
                ", --max-train-steps is " + std::to_string(c.max_train_steps) + ": nothing to do");
  if (dist.leader())
    for (const std::string& w : resume_warnings)
      con.err << ("trainer: warning: --resume: " + w + "\n") << std::flush;
  // --on-non-finite skip: the current run of skipped steps, carried across a resume so that
  // --max-consecutive-skips stops a resumed run where it would have stopped the whole one.
  int64_t skipped_in_a_row = 0;
  if (resumed)
    if (auto it = resumed->counters.find("skipped_in_a_row"); it != resumed->counters.end())
      skipped_in_a_row = std::max<int64_t>(0, it->second);
  // The best evaluation so far, carried across a resume like the skips.
  std::optional<BestEval> best_eval = resumed ? restore_best_eval(*resumed) : std::nullopt;
  const bool stopped_early =
      best_eval && c.early_stop_patience > 0 && best_eval->evals_since >= c.early_stop_patience;
  if (stopped_early && *c.resume == "auto")
    throw AlreadyFinished("the run stopped early (" + std::to_string(best_eval->evals_since) +
                          " evaluations in a row without a better loss; --early-stop-patience " +
                          std::to_string(c.early_stop_patience) +
                          "): it is finished, nothing to do");
  if (stopped_early)
    throw Error(
        "--resume: the checkpoint's run stopped early: " + std::to_string(best_eval->evals_since) +
        " evaluations in a row did not beat the best one (after step " +
        std::to_string(best_eval->step) + "); to train on, raise --early-stop-patience above " +
        std::to_string(best_eval->evals_since) + " or set it to 0");

  RunSummary summary;
  summary.name = c.name;
  summary.mode = mode->name();
  summary.optimizer = plugin.info().name;
  summary.parameters = count_elements(model->parameters());
  con.out << (c.name.empty() ? "" : "[" + c.name + "] ") << "model: " << model->describe()
          << (c.gradient_checkpointing ? ", blocks recomputed in backward" : "")
          << "; data: " << data_text(c, *data, eval_data.get())
          << "; optimizer: " << plugin.info().name << " (" << summary.mode << ", "
          << mode->optimizers().size() << " optimizer"
          << (mode->optimizers().size() == 1 ? "" : "s") << "); threads: " << used.intra_op
          << " intra-op"
          << (used.blas > 0 ? ", " + std::to_string(used.blas) + " OpenBLAS" : std::string())
          << "\n"
          << (grouped.summary.empty()
                  ? ""
                  : (c.name.empty() ? "" : "[" + c.name + "] ") + grouped.summary + "\n")
          << (initial_weights.empty() ? ""
                                      : (c.name.empty() ? "" : "[" + c.name + "] ") +
                                            "initial weights: " + initial_weights + "\n")
          << (ema ? (c.name.empty() ? "" : "[" + c.name + "] ") + "EMA of the parameters: decay " +
                        format_real(c.ema_decay) +
                        " (warm-up min(decay, (1 + t) / (10 + t))); evaluations and --save-model "
                        "use the average\n"
                  : std::string())
          << std::flush;  // a log redirected to a file has it even if the run is killed

  if (resumed)
    con.out << (c.name.empty() ? "" : "[" + c.name + "] ") << "resuming from " << resumed_from
            << " (step " << first_step << ")"
            << (c.init_weights ? "; --init-weights is not used: the checkpoint holds the weights"
                               : "")
            << "\n"
            << std::flush;
  std::optional<OutputFolderLock> folder_lock;  // held until the run ends
  if (!c.output_dir.empty() && dist.leader()) {
    folder_lock.emplace(c.output_dir);
    remove_stale_temporaries(c.output_dir);  // from killed runs
    const size_t earlier = list_checkpoints(c.output_dir).size();
    if (!resumed && earlier > 0)
      con.err << ("trainer: warning: --output-dir " + c.output_dir + " already holds " +
                  std::to_string(earlier) +
                  " checkpoint(s) of an earlier run: this run replaces its metrics files and the "
                  "checkpoints of the steps it saves, and leaves the others (use another "
                  "--output-dir to keep runs apart)\n")
              << std::flush;
  }
  // A resumed run's files continue the history of the run its checkpoint came from.
  const bool scaled = so.loss_scaler != nullptr;
  // One lr column per parameter group, whatever the step mode made of them.
  const std::vector<std::pair<size_t, size_t>> lr_at = lr_sources(groups, mode->optimizers());
  const MetricsColumns columns{lr_at.size(), scaled, c.evaluates()};
  MetricsHistory history;
  if (resumed && dist.leader()) {
    const std::string folder = fs::path(resumed_from).parent_path().string();
    const auto saved = resumed->meta.find("last_metrics_record");
    history = read_metrics_history(folder, first_step, columns,
                                   saved == resumed->meta.end() ? nullptr : &saved->second);
    if (history.not_the_checkpoints_run && !c.output_dir.empty())
      con.err << ("trainer: warning: --resume: the metrics files in " + folder +
                  " are not the history of steps 1.." + std::to_string(first_step) +
                  " of the run that wrote the checkpoint (another run has written them since), "
                  "so this run's metrics files start at step " +
                  std::to_string(first_step + 1) + "\n")
              << std::flush;
    if (history.csv_columns_differ && !c.output_dir.empty())
      con.err << ("trainer: warning: --resume: " + (fs::path(folder) / "metrics.csv").string() +
                  " has other columns than this run's (other parameter groups, or a "
                  "loss scale or evaluation switched on or off), so this run's metrics.csv starts "
                  "at step " +
                  std::to_string(first_step + 1) + "; metrics.jsonl keeps every step\n")
              << std::flush;
  }
  resumed.reset();  // everything is restored: training must not carry the checkpoint's copy
  MetricsFiles files(dist.leader() ? c.output_dir : "", columns, std::move(history));
  const CheckpointContext ckpt_ctx{c,
                                   plugin,
                                   *model,
                                   *mode,
                                   scheduler,
                                   *data,
                                   dist.comm,
                                   dist.leader(),
                                   so.shard_optimizer_state,
                                   &skipped_in_a_row,
                                   so.loss_scaler.get(),
                                   &files.last_record(),  // the newest metrics record
                                   &best_eval,
                                   ema ? &*ema : nullptr,
                                   &data_print,
                                   &eval_data_print};
  Progress progress(con.out, con.terminal, c.max_train_steps, c.log_every,
                    c.name.empty() ? "" : "[" + c.name + "]", first_step);
  end_bar_line = [&progress] { progress.finish(); };
  struct Unhook {  // `progress` dies before the step mode that holds the warning callback
    std::function<void()>& f;
    ~Unhook() {
      f = [] {};
    }
  } unhook{end_bar_line};
  const bool autocast = autocast_enabled(c);

  // ---- training: errors here are failures of the run
  const Clock::time_point start = Clock::now();
  bool first = true;
  bool stop_requested = false;  // a signal, on any rank: save and stop after this step
  int64_t step = first_step;
  try {
    for (step = first_step + 1; step <= c.max_train_steps; ++step) {
      const Clock::time_point t0 = Clock::now();
      memory::reset_peak();  // the CPU counter, and the CUDA allocator's peak on CUDA
      double loss_sum = 0;
      const double loss_scale = scaled ? so.loss_scaler->scale() : 0;  // before step() moves it
      bool bad_loss = false;  // --on-non-finite skip: this step's update is dropped
      for (int64_t micro = 0; micro < c.gradient_accumulation_steps; ++micro) {
        Batch batch =
            to_device(shard(data->next(), dist.config.rank, world), device, dtype, loss_dtype);
        if (share_buffers) {
          std::vector<at::Tensor> buffers;
          for (const auto& [name, t] : model->buffers()) buffers.push_back(t);
          broadcast_parameters(*dist.comm, buffers, 0);
        }
        memory::mark_phase("forward");
        at::Tensor loss;
        {
          AutocastGuard guard(autocast, device.type(), autocast_dtype(c));
          loss = model->loss(batch);
        }
        if (!loss.requires_grad())
          throw Error(
              "the model's loss does not depend on any trainable parameter, so there is "
              "nothing to train" +
              (c.model_script ? " (check that --model-script " + *c.model_script +
                                    "'s forward uses its parameters)"
                              : std::string()));
        if (c.gradient_accumulation_steps > 1)
          loss = loss / static_cast<double>(c.gradient_accumulation_steps);
        // Averaged over the ranks: the logged loss is the global batch's, and every rank takes
        // the same decision on a non-finite loss.
        bool stop = interrupt_signal() != 0;
        const double loss_value =
            mean_over_ranks(loss.detach().to(at::kDouble).item<double>(), dist, stop);
        stop_requested = stop_requested || stop;
        if (!std::isfinite(loss_value)) {
          // Caught before backward: in fused and grouped modes nothing has been updated yet.
          if (c.on_non_finite == "stop")
            throw NonFiniteError("non-finite loss (" + std::to_string(loss_value) +
                                 "); no parameter was updated in this step");
          bad_loss = true;
        }
        loss_sum += loss_value;
        if (bad_loss) continue;
        memory::mark_phase("backward");
        mode->backward(loss);
      }
      memory::mark_phase("step");
      StepStats stats;
      if (bad_loss) {
        for (const auto& opt : mode->optimizers()) opt->zero_grad(true);
        stats.skipped = true;
        if (dist.leader()) {  // the loss is the ranks' mean: every rank skips this step alike
          progress.finish();
          con.err << ("trainer: warning: non-finite loss at step " + std::to_string(step) +
                      ": this step's update was skipped\n")
                  << std::flush;
        }
      } else {
        stats = mode->step();
      }
      if (stats.overflow) {
        // Expected now and then with a dynamic scale (most at the start, while it settles): not
        // a failure, and not part of --max-consecutive-skips' count.
        ++summary.overflow_steps;
        if (dist.leader())
          con.err << ("trainer: step " + std::to_string(step) +
                      ": gradients overflowed at loss scale " + scale_text(loss_scale) +
                      ": update skipped, scale lowered to " + scale_text(so.loss_scaler->scale()) +
                      "\n")
                  << std::flush;
      } else {
        skipped_in_a_row = stats.skipped ? skipped_in_a_row + 1 : 0;
        summary.skipped_steps += stats.skipped;
      }
      // A run that only skips is not training: say so rather than spend the remaining steps.
      if (c.max_consecutive_skips > 0 && skipped_in_a_row >= c.max_consecutive_skips)
        throw NonFiniteError(
            "the last " + std::to_string(skipped_in_a_row) +
            " steps were all skipped (non-finite loss or gradients), so the model is no longer "
            "learning; lower the learning rate or check the data, then resume from an earlier "
            "checkpoint (--max-consecutive-skips sets this limit, 0 never stops)");
      StepMetrics m;
      m.step = step;
      m.loss = loss_sum;
      for (const auto& [i, j] : lr_at) {
        m.lrs.push_back(mode->optimizers()[i]->lr(j));
        m.effective_lrs.push_back(mode->optimizers()[i]->effective_lr(j));
      }
      m.grad_norm = stats.grad_norm;
      m.loss_scale = loss_scale;
      // A dropped update does not use up the schedule (as accelerate does after a skipped step).
      if (!stats.skipped) scheduler.step();
      if (!stats.skipped && ema) ema->update();
      memory::mark_phase("idle");
      if (device.is_cpu()) {
        m.peak_bytes = memory::peak_bytes();
        int64_t best = -1;
        for (const auto& p : memory::phase_peaks())
          if (p.peak_bytes > best) best = p.peak_bytes, m.peak_phase = p.phase;
      } else {
        m.peak_bytes = memory::cuda_stats().peak_allocated;
      }
      m.step_seconds = seconds_since(t0);
      const bool final = step == c.max_train_steps;
      if (eval_data && ((c.eval_every > 0 && step % c.eval_every == 0) || final ||
                        c.ends_epochs(step, c.eval_every_n_epochs))) {
        std::optional<ParameterEma::Swap> averaged;  // --ema-decay: the average is evaluated
        if (ema) averaged.emplace(*ema);
        m.eval_loss = evaluate(*model, *eval_data, c, dist, device, dtype, loss_dtype);
        summary.eval_loss = m.eval_loss;
        if (std::isfinite(*m.eval_loss) && (!best_eval || *m.eval_loss < best_eval->loss)) {
          best_eval = BestEval{*m.eval_loss, step};
          if (c.save_best_eval && dist.leader())
            write_model(*model, *c.save_model, c.save_precision);
        } else if (best_eval) {
          ++best_eval->evals_since;
        }
      }
      // --early-stop-patience: this step ends the run, saved and summed up as the last one would.
      const bool early = !final && c.early_stop_patience > 0 && best_eval &&
                         best_eval->evals_since >= c.early_stop_patience;
      if (first) summary.first_loss = m.loss, first = false;
      summary.last_loss = m.loss;
      summary.steps = step - first_step;
      if (m.peak_bytes > summary.peak_bytes)
        summary.peak_bytes = m.peak_bytes, summary.peak_phase = m.peak_phase;
      files.add(m);
      progress.update(m, seconds_since(start));
      // Alone, a signal is seen at once; ranks agreed on it in the loss's all-reduce.
      if (!dist.comm) stop_requested = stop_requested || interrupt_signal() != 0;
      const bool stopping = stop_requested && !final;  // saved like the final step
      // Metrics first: after a kill they cover at least the newest checkpoint's steps.
      if (checkpoint_due(c, step, final || stopping || early) && dist.leader()) files.snapshot();
      save_checkpoint_if_due(ckpt_ctx, step, final || stopping || early);
      if (early) {
        summary.stopped_early_at = step, summary.early_stop_patience = c.early_stop_patience;
        break;
      }
      if (stopping) {
        progress.finish();
        const int sig = interrupt_signal();
        throw Interrupted(
            sig, failed_in + "stopped by " + signal_name(sig != 0 ? sig : SIGTERM) +
                     " after step " + std::to_string(step) +
                     (c.output_dir.empty()
                          ? std::string(" (no --output-dir: nothing was saved)")
                          : ": saved " + (fs::path(c.output_dir) / checkpoint_name(step)).string() +
                                "; continue with --resume latest"));
      }
    }
  } catch (const Interrupted&) {
    throw;
  } catch (const std::exception& e) {
    progress.finish();
    const std::string oom = out_of_memory_text(e.what(), c);
    throw TrainingFailed(failed_in + "training failed at step " + std::to_string(step) + ": " +
                         (oom.empty() ? first_line(e.what()) : oom));
  } catch (...) {
    progress.finish();
    throw TrainingFailed(failed_in + "training failed at step " + std::to_string(step) +
                         ": the optimizer " + plugin.info().name +
                         " threw a value that is not a std::exception (a bug in the plugin)");
  }
  progress.finish();
  summary.wall_seconds = seconds_since(start);
  if (best_eval) summary.best_eval_loss = best_eval->loss, summary.best_eval_step = best_eval->step;
  if (scaled) summary.loss_scale = so.loss_scaler->scale();
  memory::Breakdown acct;
  try {
    acct = memory::account(*mode, summary.peak_bytes);  // reads the optimizers' state
  } catch (const std::exception& e) {
    throw TrainingFailed(failed_in + first_line(e.what()));
  }
  for (const auto& [name, t] : grouped.frozen)  // the mode accounts the trained ones
    acct.weights += t.numel() * static_cast<int64_t>(t.element_size());
  if (ema)
    for (const auto& [name, avg] : ema->averages())
      acct.ema += avg.numel() * static_cast<int64_t>(avg.element_size());
  summary.memory_breakdown = memory::describe(acct, mode->name());
  summary.weights_bytes = acct.weights, summary.state_bytes = acct.state;
  summary.grads_alive_bytes = acct.grads_alive;
  try {
    files.commit(summary);
  } catch (const std::exception& e) {  // trained, but the record of it failed (a full disk?)
    throw TrainingFailed(failed_in + first_line(e.what()) +
                         (c.output_dir.empty() ? std::string()
                                               : " (training finished; its checkpoints are in " +
                                                     c.output_dir + ")"));
  }
  if (c.save_best_eval && !best_eval && dist.leader())
    con.err << ("trainer: warning: " + c.message_prefix() +
                "no evaluation had a finite loss, so --save-model " + *c.save_model +
                " was not written (--save-model-at best)\n")
            << std::flush;
  if (c.save_model && !c.save_best_eval && dist.leader()) {
    try {
      std::optional<ParameterEma::Swap> averaged;  // --ema-decay: the average is the result
      if (ema) averaged.emplace(*ema);
      write_model(*model, *c.save_model, c.save_precision);
    } catch (const std::exception& e) {
      throw TrainingFailed(failed_in + first_line(e.what()) +
                           (c.output_dir.empty()
                                ? std::string()
                                : " (the weights are in the checkpoint in " + c.output_dir + ")"));
    }
  }
  return summary;
}

}  // namespace fusebox::trainer
