#include "config.h"

#include <filesystem>
#include <fstream>

#include "fusebox/core/loss_scaler.h"
#include "fusebox/core/messages.h"
#include "fusebox/core/safetensors.h"
#include "fusebox/core/suggest.h"
#include "fusebox/error.h"

namespace fusebox::trainer {

namespace {

namespace fs = std::filesystem;

class Reader {
 public:
  explicit Reader(const Layer& l) : layer_(l) {}
  bool has(const std::string& name) const { return layer_.values.count(name) != 0; }
  const Setting& setting(const std::string& name) const {
    auto it = layer_.values.find(name);
    if (it == layer_.values.end()) throw Error("internal: option --" + name + " has no value");
    return it->second;
  }
  template <class T>
  T get(const std::string& name) const {
    return std::get<T>(setting(name).value);
  }
  template <class T>
  std::optional<T> maybe(const std::string& name) const {
    if (!has(name)) return std::nullopt;
    return get<T>(name);
  }
  /// An optional path: an empty value (`--resume ""`) unsets one that a config gave.
  std::optional<std::string> maybe_path(const std::string& name) const {
    std::optional<std::string> v = maybe<std::string>(name);
    if (v && v->empty()) return std::nullopt;
    return v;
  }
  /// "--x" or "run.toml:3:1: x", for messages.
  std::string label(const std::string& name) const {
    return origin_label(name, has(name) ? setting(name).where : "");
  }

 private:
  const Layer& layer_;
};

}  // namespace

void check_readable_file(const std::string& label, const std::string& path, const char* what) {
  const std::string named = (label.empty() ? "" : label + ": ") + what + " " + path;
  std::error_code ec;
  if (!fs::exists(path, ec)) throw Error(named + does_not_exist(ec));
  if (fs::is_directory(path, ec)) throw Error(named + " is a folder");
  // A pipe or device would block the trainer or never end; only files are read.
  if (!fs::is_regular_file(path, ec)) throw Error(named + " is not a regular file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(named + " cannot be read");
}

bool TrainConfig::ends_epochs(int64_t step, int64_t every) const {
  if (every <= 0 || epoch_samples <= 0 || step < 1 || every > (int64_t{1} << 40) / epoch_samples)
    return false;
  const int64_t per_step = train_batch_size * gradient_accumulation_steps;
  const int64_t samples = every * epoch_samples;
  return (step * per_step) / samples > ((step - 1) * per_step) / samples;
}

std::string TrainConfig::message_prefix() const {
  return name.empty() ? "" : "run '" + name + "': ";
}

std::string TrainConfig::mode() const {
  if (fused_backward_pass) return "fused";
  if (fused_optimizer_groups > 0) return "groups";
  return "normal";
}

TrainConfig resolve_config(const Layer& merged, const std::string& run_name) {
  Reader r(merged);
  TrainConfig c;
  c.name = run_name;

  c.optimizer_plugin = r.maybe<std::string>("optimizer-plugin");
  c.optimizer = r.maybe<std::string>("optimizer");
  if (c.optimizer_plugin && c.optimizer)
    throw Error(r.label("optimizer") + ": cannot be combined with --optimizer-plugin; give one");
  if (!c.optimizer_plugin && !c.optimizer)
    throw Error(
        "no optimizer: give --optimizer-plugin PATH|FILE or --optimizer NAME "
        "(trainer --list-plugins shows what is installed)");
  if ((c.optimizer_plugin && c.optimizer_plugin->empty()) || (c.optimizer && c.optimizer->empty()))
    throw Error(r.label(c.optimizer ? "optimizer" : "optimizer-plugin") + ": must not be empty");
  c.plugin_dirs = r.get<std::vector<std::string>>("plugin-dir");
  c.allow_insecure_plugins = r.get<bool>("allow-insecure-plugins");
  c.optimizer_args = merged.optimizer_args;

  c.learning_rate = r.maybe<double>("learning-rate");
  if (c.learning_rate) {
    c.learning_rate_where = r.label("learning-rate");
    auto it = c.optimizer_args.find("lr");
    if (it != c.optimizer_args.end())
      throw Error(c.learning_rate_where +
                  ": the learning rate is also given as optimizer argument "
                  "lr (" +
                  it->second.where + "); give it once");
  }
  c.lr_scheduler = r.get<std::string>("lr-scheduler");
  c.lr_scheduler_power = r.get<double>("lr-scheduler-power");
  c.lr_scheduler_num_cycles = r.get<double>("lr-scheduler-num-cycles");
  c.lr_warmup_steps = r.get<int64_t>("lr-warmup-steps");
  c.max_train_steps = r.get<int64_t>("max-train-steps");
  c.train_batch_size = r.get<int64_t>("train-batch-size");
  c.gradient_accumulation_steps = r.get<int64_t>("gradient-accumulation-steps");
  c.max_grad_norm = r.get<double>("max-grad-norm");
  for (const std::string& entry : r.get<std::vector<std::string>>("lr-scale"))
    c.param_group_rules.lr_scale.push_back(parse_lr_scale(entry, r.label("lr-scale")));
  c.param_group_rules.lr_scale_label = r.label("lr-scale");
  c.param_group_rules.no_weight_decay = r.get<std::vector<std::string>>("no-weight-decay");
  c.param_group_rules.no_weight_decay_label = r.label("no-weight-decay");
  for (const std::string& glob : c.param_group_rules.no_weight_decay)
    if (glob.empty()) throw Error(r.label("no-weight-decay") + ": a glob must not be empty");
  c.param_group_rules.freeze = r.get<std::vector<std::string>>("freeze");
  c.param_group_rules.freeze_label = r.label("freeze");
  for (const std::string& glob : c.param_group_rules.freeze)
    if (glob.empty()) throw Error(r.label("freeze") + ": a glob must not be empty");
  c.ema_decay = r.get<double>("ema-decay");
  if (c.ema_decay >= 1)
    throw Error(r.label("ema-decay") + ": " + format_real(c.ema_decay) +
                " would never move the average; give a decay below 1 (e.g. 0.999), or 0 for none");
  c.fused_backward_pass = r.get<bool>("fused-backward-pass");
  c.fused_optimizer_groups = r.maybe<int64_t>("fused-optimizer-groups").value_or(0);
  c.fused_optimizer_groups_split = r.get<std::string>("fused-optimizer-groups-split");
  c.on_non_finite = r.get<std::string>("on-non-finite");
  c.max_consecutive_skips = r.get<int64_t>("max-consecutive-skips");

  const bool grouped = c.fused_optimizer_groups > 0;  // 0 switches off a config's groups
  if (c.on_non_finite == "skip" && (c.fused_backward_pass || grouped))
    throw Error(r.label("on-non-finite") +
                ": skip is possible only in normal mode: with --fused-backward-pass or "
                "--fused-optimizer-groups some parameters are already updated when a later "
                "gradient turns out non-finite (use stop)");
  if (c.fused_backward_pass && grouped)
    throw Error(r.label("fused-optimizer-groups") +
                ": cannot be combined with --fused-backward-pass; choose one of the two modes");
  if (c.gradient_accumulation_steps > 1 && (c.fused_backward_pass || grouped)) {
    const std::string mode =
        c.fused_backward_pass ? "--fused-backward-pass" : "--fused-optimizer-groups";
    throw Error(r.label("gradient-accumulation-steps") + ": " +
                std::to_string(c.gradient_accumulation_steps) + " cannot be used with " + mode +
                ": parameters are updated during backward, so gradients cannot accumulate");
  }

  c.mixed_precision = r.get<std::string>("mixed-precision");
  c.full_bf16 = r.get<bool>("full-bf16");
  c.memory_guard = r.get<std::string>("memory-guard") == "on";
  c.dtype = r.get<std::string>("dtype");
  c.device = r.get<std::string>("device");
  c.seed = r.get<int64_t>("seed");
  c.threads = r.get<int64_t>("threads");
  c.threads_given = !r.setting("threads").where.empty();
  c.blas_threads = r.get<int64_t>("blas-threads");
  c.blas_threads_given = !r.setting("blas-threads").where.empty();
  c.nproc_per_node = r.get<int64_t>("nproc-per-node");
  c.dist_timeout = r.get<double>("dist-timeout");
  c.dist_bucket_mb = r.get<double>("dist-bucket-mb");
  c.shard_optimizer_state = r.get<bool>("shard-optimizer-state");
  if (c.full_bf16 && c.mixed_precision == "fp16")
    throw Error(r.label("full-bf16") + ": cannot be combined with --mixed-precision fp16");
  if (c.full_bf16 && c.dtype == "float64")
    throw Error(r.label("full-bf16") + ": cannot be combined with --dtype float64");
  if (c.mixed_precision != "no" && c.dtype == "float64")
    throw Error(r.label("mixed-precision") + ": " + c.mixed_precision +
                " cannot be combined with --dtype float64");
  const std::string loss_scale = r.get<std::string>("loss-scale");
  c.loss_scale = loss_scale != "auto"          ? loss_scale
                 : c.mixed_precision == "fp16" ? "dynamic"
                                               : "none";
  c.loss_scale_value = r.get<double>("loss-scale-value");
  c.loss_scale_growth_interval = r.get<int64_t>("loss-scale-growth-interval");
  if (c.loss_scale == "dynamic" && c.loss_scale_value < LossScaleOptions{}.min_scale)
    throw Error(r.label("loss-scale-value") +
                ": a dynamic scale must start at 2^-16 (1.5e-05) or "
                "above, where it stops lowering itself; use a larger value or --loss-scale fixed");
  if (c.loss_scale == "dynamic" && (c.fused_backward_pass || grouped)) {
    const std::string mode =
        c.fused_backward_pass ? "--fused-backward-pass" : "--fused-optimizer-groups";
    const std::string why =
        ": a dynamic loss scale skips a step whose gradients overflowed, after seeing all of "
        "them, but " +
        mode +
        " has applied the earlier ones by then; use --loss-scale fixed (--loss-scale-value, "
        "65536 by default: an overflow then stops the run, and you resume with a lower value), "
        "--loss-scale none, or bf16";
    if (loss_scale == "auto")
      throw Error(r.label("mixed-precision") + ": fp16 with " + mode +
                  " needs a loss scale chosen with --loss-scale" + why);
    throw Error(r.label("loss-scale") + ": dynamic cannot be used with " + mode + why);
  }

  c.model = r.get<std::string>("model");
  c.model_width = r.get<int64_t>("model-width");
  c.model_depth = r.get<int64_t>("model-depth");
  c.model_heads = r.get<int64_t>("model-heads");
  c.seq_len = r.get<int64_t>("seq-len");
  c.vocab_size = r.get<int64_t>("vocab-size");
  c.token_dtype = r.get<std::string>("token-dtype");
  c.image_size = r.get<int64_t>("image-size");
  c.model_script = r.maybe_path("model-script");
  c.gradient_checkpointing = r.get<bool>("gradient-checkpointing");
  if (c.gradient_checkpointing && c.model_script)
    throw Error(r.label("gradient-checkpointing") +
                ": works with the built-in models only; a --model-script module runs as one "
                "TorchScript call, whose activations fusebox cannot recompute");
  if (c.model_script) check_readable_file(r.label("model-script"), *c.model_script, "file");
  c.init_weights = r.maybe_path("init-weights");
  if (c.init_weights) check_readable_file(r.label("init-weights"), *c.init_weights, "file");
  c.init_weights_strict = r.get<bool>("init-weights-strict");
  if (!c.init_weights_strict && !c.init_weights)
    throw Error(r.label("init-weights-strict") +
                ": says how --init-weights is read, and --init-weights is unset; give "
                "--init-weights FILE");
  if (!c.model_script) {
    if (c.model == "transformer" && c.model_width % c.model_heads != 0)
      throw Error(r.label("model-heads") + ": " + std::to_string(c.model_heads) +
                  " does not divide --model-width " + std::to_string(c.model_width));
    // Each level halves the image: depth - 1 halvings must divide it (past 2^62 none can).
    const int64_t halvings = std::min<int64_t>(c.model_depth - 1, 62);
    const int64_t factor = int64_t{1} << halvings;
    if (c.model == "denoiser" && (halvings < c.model_depth - 1 || c.image_size % factor != 0))
      throw Error(r.label("image-size") + ": " + std::to_string(c.image_size) +
                  " must be divisible by " + std::to_string(factor) + " (2^(model-depth - 1))");
  }

  // --dataset and --eval-dataset: "synthetic", "none", or "text" or "tensors" with a readable
  // file (what the file holds is checked against the model when the data are made).
  auto read_dataset = [&](const std::string& option, std::string& kind, std::string& path) {
    const std::string spec = r.get<std::string>(option);
    const std::string label = r.label(option);
    if (spec == "synthetic" || spec == "none") {
      kind = spec;
    } else if (spec.rfind("text:", 0) == 0) {
      kind = "text";
      path = spec.substr(5);
      if (path.empty()) throw Error(label + ": text: needs a path (text:PATH)");
      check_readable_file(label, path, "text file");
    } else if (spec.rfind("tensors:", 0) == 0) {
      kind = "tensors";
      path = spec.substr(8);
      if (path.empty()) throw Error(label + ": tensors: needs a path (tensors:PATH)");
      // A folder holds the files of a dataset in shards (tensor_data.h reads them).
      std::error_code ec;
      if (!fs::is_directory(path, ec)) check_readable_file(label, path, "tensors file");
    } else {
      std::string hint = did_you_mean(spec, {"synthetic", "none", "text:PATH", "tensors:PATH"});
      throw Error(label + ": '" + spec + "' is not synthetic, none, text:PATH or tensors:PATH" +
                  hint);
    }
    if (!c.model_script) {
      if (kind == "none")
        throw Error(label + ": the built-in " + c.model +
                    " model needs data; none is for --model-script");
      if (kind == "text" && c.model != "transformer")
        throw Error(label + ": text data is for the transformer model, not " + c.model);
    }
  };
  read_dataset("dataset", c.dataset, c.dataset_path);
  // The options counted in epochs: only tensors data have them.
  auto counts_epochs = [&](const char* option, int64_t value, const char* instead) {
    if (value > 0 && c.dataset != "tensors")
      throw Error(r.label(option) +
                  ": counts passes over a --dataset tensors:PATH file's samples, and " + c.dataset +
                  " data have no epochs; give " + instead);
  };
  c.eval_every = r.get<int64_t>("eval-every");
  c.eval_every_n_epochs = r.get<int64_t>("eval-every-n-epochs");
  counts_epochs("eval-every-n-epochs", c.eval_every_n_epochs, "--eval-every N");
  c.eval_batches = r.get<int64_t>("eval-batches");
  c.early_stop_patience = r.get<int64_t>("early-stop-patience");
  if (c.early_stop_patience > 0 && !c.evaluates())
    throw Error(r.label("early-stop-patience") +
                ": counts evaluations, and there are none; give --eval-every N");
  if (!c.evaluates())
    for (const char* option : {"eval-batches", "eval-dataset"})
      if (r.has(option) && !r.setting(option).where.empty()) c.eval_set_unused = r.label(option);
  if (r.maybe<std::string>("eval-dataset").value_or("").empty()) {
    c.eval_dataset = c.dataset, c.eval_dataset_path = c.dataset_path;
  } else {
    read_dataset("eval-dataset", c.eval_dataset, c.eval_dataset_path);
    if (c.model_script && (c.eval_dataset == "none") != (c.dataset == "none"))
      throw Error(r.label("eval-dataset") + ": " + (c.dataset == "none" ? "--dataset is" : "is") +
                  " none: a script model takes data for both or for neither");
  }
  // --eval-holdout splits the one file: training never sees the evaluation's bytes or samples.
  if (const std::optional<double> holdout = r.maybe<double>("eval-holdout")) {
    const std::string label = r.label("eval-holdout");
    if (c.dataset != "text" && c.dataset != "tensors")
      throw Error(label + ": holds out the end of a text or tensors file, but --dataset is " +
                  c.dataset +
                  " (give --dataset text:PATH or tensors:PATH, or leave it unset: the "
                  "evaluation's " +
                  c.dataset + " batches are a stream of their own already)");
    if (!r.maybe<std::string>("eval-dataset").value_or("").empty())
      throw Error(label + " and " + r.label("eval-dataset") +
                  " both choose the evaluation's data: give one of them");
    c.eval_holdout = *holdout;
  }
  // --eval-batches 0: one pass over a file's samples (a text file's: its windows one after
  // another), which synthetic data, having no end, lack.
  if (c.eval_batches == 0 && c.evaluates() && c.eval_dataset != "tensors" &&
      c.eval_dataset != "text")
    throw Error(r.label("eval-batches") +
                ": 0 evaluates every sample of a tensors or text file once, and the evaluation's "
                "data are " +
                c.eval_dataset +
                " (give --eval-dataset tensors:PATH or text:PATH, or --dataset tensors:PATH or "
                "text:PATH with --eval-holdout F; or N >= 1 batches)");
  // --max-train-epochs: the run's length in passes over the training samples (the steps are
  // worked out from the file by set_steps_from_epochs, when the run is planned).
  c.max_train_epochs = r.get<int64_t>("max-train-epochs");
  counts_epochs("max-train-epochs", c.max_train_epochs, "--max-train-steps");
  if (c.max_train_epochs > 0) {
    const std::string label = r.label("max-train-epochs");
    if (!r.setting("max-train-steps").where.empty())
      throw Error(label + " and " + r.label("max-train-steps") +
                  " both set the run's length: give one (--max-train-epochs 0 switches epochs "
                  "off)");
  }

  c.output_dir = r.get<std::string>("output-dir");
  c.log_every = r.get<int64_t>("log-every");
  c.save_every_n_steps = r.get<int64_t>("save-every-n-steps");
  c.save_every_n_epochs = r.get<int64_t>("save-every-n-epochs");
  counts_epochs("save-every-n-epochs", c.save_every_n_epochs, "--save-every-n-steps");
  c.keep_last_n_checkpoints = r.get<int64_t>("keep-last-n-checkpoints");
  c.resume = r.maybe_path("resume");
  c.save_model = r.maybe_path("save-model");
  c.save_best_eval = r.get<std::string>("save-model-at") == "best";
  if (c.save_best_eval && !c.save_model)
    throw Error(r.label("save-model-at") +
                ": best chooses what --save-model holds, and --save-model is unset; give "
                "--save-model PATH");
  if (const std::string p = r.get<std::string>("save-precision"); p != "same") {
    c.save_precision = p == "float32" ? c10::kFloat : p == "fp16" ? c10::kHalf : c10::kBFloat16;
    if (!c.save_model)
      throw Error(r.label("save-precision") +
                  ": sets what --save-model writes, and --save-model is unset; give --save-model "
                  "PATH");
    if (c.model_script && !is_safetensors_path(*c.save_model))
      throw Error(r.label("save-precision") + ": a --model-script module is saved as itself " +
                  "(TorchScript), in the types it trained in; give --save-model a .safetensors " +
                  "path to save its weights as " + p);
  }
  if (c.save_best_eval && !c.evaluates())
    throw Error(r.label("save-model-at") +
                ": best keeps the parameters of the best evaluation, and there are none; "
                "give --eval-every N");
  if (c.resume) {
    std::error_code ec;
    const bool in_output_dir = *c.resume == "latest" || *c.resume == "auto";
    if (!in_output_dir && !fs::exists(*c.resume, ec))
      throw Error(r.label("resume") + ": checkpoint " + *c.resume + does_not_exist(ec));
    // A pipe or device would block the trainer (or never end): a checkpoint is a file or folder.
    if (!in_output_dir && !fs::is_regular_file(*c.resume, ec) && !fs::is_directory(*c.resume, ec))
      throw Error(r.label("resume") + ": " + *c.resume +
                  " is neither a checkpoint file nor a folder of checkpoints");
  }
  if (c.resume && (*c.resume == "latest" || *c.resume == "auto") && c.output_dir.empty())
    throw Error(r.label("resume") + ": " + *c.resume +
                " means the newest checkpoint in --output-dir, which is empty; give --output-dir "
                "or a checkpoint's path");
  for (const char* every : {"save-every-n-steps", "save-every-n-epochs"})
    if (r.get<int64_t>(every) > 0 && c.output_dir.empty())
      throw Error(r.label(every) +
                  ": checkpoints live in --output-dir, which is empty; give one, " + "or --" +
                  every + " 0");
  if (c.save_model) {
    fs::path parent = fs::path(*c.save_model).parent_path();
    std::error_code ec;
    if (c.save_model->back() == '/' || fs::is_directory(*c.save_model, ec))
      throw Error(r.label("save-model") + ": " + *c.save_model +
                  " is a folder; give a file name (e.g. " +
                  (fs::path(*c.save_model) / "model.pt").lexically_normal().string() + ")");
    // The output folder (or one below it) is made by the trainer, so it need not exist yet.
    const auto inside_output_dir = [&] {
      if (c.output_dir.empty()) return false;
      const fs::path out = fs::absolute(c.output_dir).lexically_normal();
      const fs::path rel = fs::absolute(parent).lexically_normal().lexically_relative(out);
      return !rel.empty() && *rel.begin() != "..";
    };
    if (!parent.empty() && !fs::is_directory(parent, ec) && !inside_output_dir())
      throw Error(r.label("save-model") + ": " +
                  (fs::exists(parent, ec) ? parent.string() + " is not a folder"
                                          : "folder " + parent.string() + does_not_exist(ec)));
  }
  return c;
}

}  // namespace fusebox::trainer
