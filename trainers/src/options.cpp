#include "options.h"

#include <algorithm>
#include <boost/program_options.hpp>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <sstream>

#include "fusebox/core/hyperparam_validation.h"
#include "fusebox/core/suggest.h"
#include "fusebox/core/threads.h"
#include "fusebox/error.h"

namespace fusebox::trainer {

namespace po = boost::program_options;

namespace {

constexpr double kMaxThreads = 1024;    // per pool; more only ever slows a run down
constexpr double kMaxLocalRanks = 256;  // processes one launcher starts
// Layers/blocks/levels of a built-in model: far beyond what trains well, and bounded so that a
// typo does not build modules until memory runs out.
constexpr double kMaxModelDepth = 10000;

OptionSpec opt(std::string name, Kind kind, std::optional<OptValue> def, std::string help,
               std::string metavar = "") {
  OptionSpec s;
  s.name = std::move(name), s.kind = kind, s.def = std::move(def), s.help = std::move(help);
  s.metavar = std::move(metavar);
  return s;
}

std::vector<OptionSpec> build_specs() {
  std::vector<OptionSpec> v;
  std::string section;
  auto add = [&](OptionSpec s) -> OptionSpec& {
    s.section = section;
    v.push_back(std::move(s));
    return v.back();
  };
  auto at_least = [](OptionSpec& s, double m) { s.min = m; };
  auto above = [](OptionSpec& s, double m) { s.min = m, s.min_open = true; };
  auto at_most = [](OptionSpec& s, double m) { s.max = m; };
  auto choices = [](OptionSpec& s, std::vector<std::string> c) { s.choices = std::move(c); };
  const int64_t cores = available_cores();

  section = "General";
  add(opt("config", Kind::ActionArg, {}, "read options from this TOML file (the command line wins)",
          "FILE"));
  add(opt("run", Kind::ActionArg, {},
          "with [[runs]] in the config: train only the run of this name (repeatable)", "NAME"));
  add(opt("print-config", Kind::Action, {},
          "print the fully resolved configuration as TOML and exit"));
  add(opt("list-params", Kind::Action, {},
          "print the model's parameters with the lr and weight decay each trains with, and "
          "exit"));
  add(opt("check-data", Kind::Action, {},
          "make the training and evaluation data as a run would, checking every value, print "
          "what the model gets, and exit (nothing is trained or written)"));
  add(opt("help", Kind::Action, {}, "print this help and exit"));
  add(opt("version", Kind::Action, {}, "print the version and exit"));

  section = "Optimizer plugin";
  add(opt("optimizer-plugin", Kind::Text, {},
          "plugin to load: a path (contains '/') or a file name in the plugin search path",
          "PATH|FILE"));
  add(opt("optimizer", Kind::Text, {}, "plugin to load by its name (e.g. sgd)", "NAME"));
  add(opt("optimizer-args", Kind::TextList, {},
          "plugin hyperparameters as key=value (TOML: an [optimizer_args] table)", "KEY=VALUE..."));
  add(opt("plugin-dir", Kind::TextList, std::vector<std::string>{},
          "folder searched for plugins before FUSEBOX_PLUGIN_PATH and the default (repeatable)",
          "DIR"));
  add(opt("allow-insecure-plugins", Kind::Flag, false,
          "load plugin files or folders that are writable by group or others"));
  add(opt("list-plugins", Kind::Action, {}, "list the plugins in the search path and exit"));
  add(opt("describe-plugin", Kind::ActionArg, {},
          "print a plugin's hyperparameters (type, default, range, help) and rules, and exit",
          "NAME"));

  section = "Optimization";
  // Past float's largest value it cannot even be applied to float32 parameters.
  at_most(add(opt("learning-rate", Kind::Real, {},
                  "learning rate, passed to the plugin as hyperparameter lr (default: the "
                  "plugin's own)",
                  "LR")),
          3.4e38);
  choices(add(opt("lr-scheduler", Kind::Choice, std::string("constant"), "learning-rate schedule",
                  "NAME")),
          {"constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts",
           "polynomial", "adafactor"});
  above(add(opt("lr-scheduler-power", Kind::Real, 1.0, "polynomial schedule: exponent", "P")), 0);
  above(add(opt("lr-scheduler-num-cycles", Kind::Real, 1.0,
                "cosine_with_restarts: number of cycles", "N")),
        0);
  at_least(add(opt("lr-warmup-steps", Kind::Int, int64_t{0}, "linear warm-up steps", "N")), 0);
  at_least(add(opt("max-train-steps", Kind::Int, int64_t{100}, "optimizer steps to train", "N")),
           1);
  at_least(add(opt("max-train-epochs", Kind::Int, int64_t{0},
                   "with --dataset tensors:PATH: train N passes over its training samples, "
                   "ceil(N x samples / (batch x accumulation)) steps, instead of "
                   "--max-train-steps (0: unset)",
                   "N")),
           0);
  at_least(add(opt("train-batch-size", Kind::Int, int64_t{8}, "samples per forward pass", "N")), 1);
  at_least(add(opt("gradient-accumulation-steps", Kind::Int, int64_t{1},
                   "forward/backward passes per optimizer step (normal mode only)", "N")),
           1);
  at_least(
      add(opt("max-grad-norm", Kind::Real, 0.0,
              "clip gradients to this norm (0: off); fused/groups clip each tensor alone", "X")),
      0);
  add(opt("lr-scale", Kind::TextList, std::vector<std::string>{},
          "train the parameters whose names match GLOB at the learning rate times F (first "
          "match wins; 0 keeps them where they are)",
          "GLOB=F..."));
  add(opt("no-weight-decay", Kind::TextList, std::vector<std::string>{},
          "parameters whose names match a GLOB get weight decay 0 (e.g. '*.bias' '*norm*')",
          "GLOB..."));
  add(opt("freeze", Kind::TextList, std::vector<std::string>{},
          "parameters whose names match a GLOB are not trained: no gradients, no optimizer "
          "state (e.g. 'tok.*')",
          "GLOB..."));
  at_least(add(opt("ema-decay", Kind::Real, 0.0,
                   "keep an exponential moving average of the parameters with this decay (below "
                   "1; 0: none): evaluations and --save-model use it",
                   "D")),
           0);
  add(opt("fused-backward-pass", Kind::Flag, false,
          "update each parameter inside backward as soon as its gradient is ready"));
  at_least(add(opt("fused-optimizer-groups", Kind::Int, {},
                   "split the parameters into N optimizers, each stepped inside backward (N >= 1; "
                   "0 switches off groups set in a config)",
                   "N")),
           0);
  choices(add(opt("fused-optimizer-groups-split", Kind::Choice, std::string("size"),
                  "how groups are cut: balanced by bytes (size) or by tensor count (count)",
                  "size|count")),
          {"size", "count"});
  choices(add(opt("on-non-finite", Kind::Choice, std::string("stop"),
                  "NaN/Inf loss or gradient: stop the run, or skip that step (normal mode only)",
                  "stop|skip")),
          {"stop", "skip"});
  at_least(add(opt("max-consecutive-skips", Kind::Int, int64_t{10},
                   "with --on-non-finite skip: stop the run after N skipped steps in a row "
                   "(0: never)",
                   "N")),
           0);

  section = "Precision and device";
  choices(add(opt("mixed-precision", Kind::Choice, std::string("no"),
                  "autocast the forward pass to bf16 or fp16 (fp16 has no CPU autocast)",
                  "no|fp16|bf16")),
          {"no", "fp16", "bf16"});
  choices(add(opt("loss-scale", Kind::Choice, std::string("auto"),
                  "multiply the loss before backward so small fp16 gradients do not underflow: "
                  "dynamic (skips overflowed steps; normal mode only), fixed, none; auto: "
                  "dynamic with --mixed-precision fp16, else none",
                  "auto|dynamic|fixed|none")),
          {"auto", "dynamic", "fixed", "none"});
  OptionSpec& scale_value = add(opt("loss-scale-value", Kind::Real, 65536.0,
                                    "the fixed loss scale, or the dynamic one's start", "X"));
  above(scale_value, 0), at_most(scale_value, 3.4e38);
  at_least(add(opt("loss-scale-growth-interval", Kind::Int, int64_t{2000},
                   "dynamic loss scale: doubles after N steps in a row without overflow", "N")),
           1);
  add(opt("full-bf16", Kind::Flag, false,
          "keep the parameters in bf16 (stochastic rounding when the plugin offers it)"));
  choices(add(opt("dtype", Kind::Choice, std::string("float32"), "parameter and data type",
                  "float32|float64")),
          {"float32", "float64"});
  choices(add(opt("device", Kind::Choice, std::string("cpu"), "where to train", "cpu|cuda")),
          {"cpu", "cuda"});
  // LibTorch's CPU generator (mt19937) keeps the low 32 bits of a seed: larger seeds would repeat
  // smaller ones' runs.
  OptionSpec& seed = add(opt("seed", Kind::Int, int64_t{42},
                             "seed of model initialisation and data (0 to 4294967295)", "N"));
  at_least(seed, 0);
  at_most(seed, 4294967295.0);
  OptionSpec& threads =
      add(opt("threads", Kind::Int, cores,
              "intra-op CPU threads (default: the cores this process may use)", "N"));
  at_least(threads, 1), at_most(threads, kMaxThreads), threads.derived_default = true;
  OptionSpec& blas_threads = add(opt("blas-threads", Kind::Int, int64_t{0},
                                     "OpenBLAS threads for matrix products (0: OpenBLAS's own "
                                     "count, at most the cores this process may use; local "
                                     "ranks share them)",
                                     "N"));
  at_least(blas_threads, 0), at_most(blas_threads, kMaxThreads);
  blas_threads.derived_default = true;
  choices(add(opt("memory-guard", Kind::Choice, std::string("on"),
                  "refuse a CPU allocation the memory free now cannot hold, with a message, "
                  "rather than be ended by the kernel's out-of-memory killer",
                  "on|off")),
          {"on", "off"});

  section = "Distributed (data parallel, c10d)";
  at_least(add(opt("nproc-per-node", Kind::Int, int64_t{1},
                   "start N local processes that train together, each on 1/N of every batch "
                   "(other machines: run the same command with torchrun's RANK, WORLD_SIZE, "
                   "MASTER_ADDR, MASTER_PORT)",
                   "N")),
           1);
  at_most(v.back(), kMaxLocalRanks);
  OptionSpec& timeout =
      add(opt("dist-timeout", Kind::Real, 300.0,
              "seconds to wait for the rendezvous or for another rank in a collective", "S"));
  at_least(timeout, 0.1), at_most(timeout, 7 * 24 * 3600.0);
  OptionSpec& bucket =
      add(opt("dist-bucket-mb", Kind::Real, 25.0,
              "gradients are averaged in buckets of this many MiB while backward runs", "MB"));
  at_least(bucket, 0.001), at_most(bucket, 1 << 20);
  add(opt("shard-optimizer-state", Kind::Flag, false,
          "ZeRO-1: each rank keeps optimizer state for, and updates, 1/N of the parameters"));

  section = "Model";
  choices(add(opt("model", Kind::Choice, std::string("mlp"), "built-in model to train",
                  "mlp|transformer|denoiser")),
          {"mlp", "transformer", "denoiser"});
  at_least(add(opt("model-width", Kind::Int, int64_t{64},
                   "hidden width (mlp, transformer) or base channels (denoiser)", "N")),
           1);
  OptionSpec& depth =
      add(opt("model-depth", Kind::Int, int64_t{2},
              "hidden layers (mlp), blocks (transformer) or resolution levels (denoiser), at most "
              "10000",
              "N"));
  at_least(depth, 1), at_most(depth, kMaxModelDepth);
  at_least(add(opt("model-heads", Kind::Int, int64_t{4},
                   "transformer: attention heads (must divide --model-width)", "N")),
           1);
  at_least(add(opt("seq-len", Kind::Int, int64_t{64}, "transformer: tokens per sequence", "N")), 2);
  at_least(
      add(opt("vocab-size", Kind::Int, int64_t{256},
              "transformer: vocabulary of the synthetic data (text data uses 256 bytes)", "N")),
      2);
  at_least(add(opt("image-size", Kind::Int, int64_t{16},
                   "denoiser: image side (divisible by 2^(model-depth - 1))", "N")),
           4);
  add(opt("gradient-checkpointing", Kind::Flag, false,
          "built-in models: keep only each block's input and recompute the block in backward "
          "(less activation memory, about one more forward pass of time; same results)"));
  add(opt("model-script", Kind::Text, {},
          "train a TorchScript module instead: forward(batch) returns the scalar loss (empty: a "
          "built-in model)",
          "FILE"));
  add(opt("init-weights", Kind::Text, {},
          "start from the parameters in this file instead of the model's initialisation: a "
          "--save-model file, a .safetensors file, a torch.save'd state_dict or a checkpoint (a "
          "resumed checkpoint wins; empty: none)",
          "FILE"));
  add(opt("init-weights-strict", Kind::Flag, true,
          "--init-weights: every parameter must be in the file and every tensor of the file in "
          "the model (false: parameters the file lacks keep their initialisation, e.g. a new "
          "head; other tensors of the file are left unused)"));

  section = "Data";
  add(opt("dataset", Kind::Text, std::string("synthetic"),
          "synthetic (from --seed), text:PATH (bytes as tokens, transformer/script), "
          "tensors:PATH (samples of your own: a safetensors, torch.save'd or NumPy file of "
          "tensors, a headerless .bin of token ids, or a folder of them; shuffled each epoch) or "
          "none",
          "SPEC"));
  choices(add(opt("token-dtype", Kind::Choice, std::string("uint16"),
                  "the type of the token ids in a headerless .bin file (--dataset tensors:, as "
                  "numpy's tofile or np.memmap write it)",
                  "uint16|uint32|int32|int64")),
          {"uint16", "uint32", "int32", "int64"});
  at_least(add(opt("eval-every", Kind::Int, int64_t{0},
                   "every N steps and after the last: the mean loss on --eval-batches held-out "
                   "batches, without gradients; training is unchanged (0: never)",
                   "N")),
           0);
  at_least(add(opt("eval-every-n-epochs", Kind::Int, int64_t{0},
                   "with --dataset tensors:PATH: evaluate also after the step in which every "
                   "N-th pass over the training samples ends (0: never)",
                   "N")),
           0);
  at_least(add(opt("eval-batches", Kind::Int, int64_t{4},
                   "batches of --train-batch-size samples in each evaluation (the same ones each "
                   "time; 0: every sample of a tensors: evaluation set once, every window of "
                   "a text: one)",
                   "N")),
           0);
  add(opt("eval-dataset", Kind::Text, {},
          "the evaluation's data, as --dataset (default: --dataset's kind, drawn from a stream "
          "of its own; give a text file of its own to hold text out)",
          "SPEC"));
  OptionSpec& holdout = add(opt("eval-holdout", Kind::Real, {},
                                "with --dataset text:PATH or tensors:PATH: the file's last "
                                "fraction F (of its bytes or samples) is for evaluation only and "
                                "never trained on (unset: nothing held out)",
                                "F"));
  above(holdout, 0);
  at_most(holdout, 0.5);
  at_least(add(opt("early-stop-patience", Kind::Int, int64_t{0},
                   "with --eval-every: stop, saving a checkpoint, after N evaluations in a row "
                   "that do not beat the best one (0: never)",
                   "N")),
           0);

  section = "Output";
  add(opt("output-dir", Kind::Text, std::string("output"),
          "metrics.jsonl, metrics.csv and summary.json go here (\"\": write no files)", "DIR"));
  at_least(add(opt("log-every", Kind::Int, int64_t{10},
                   "when not on a terminal: print a line every N steps (0: never)", "N")),
           0);
  at_least(add(opt("save-every-n-steps", Kind::Int, int64_t{0},
                   "save a checkpoint every N steps (0: only the final one)", "N")),
           0);
  at_least(add(opt("save-every-n-epochs", Kind::Int, int64_t{0},
                   "with --dataset tensors:PATH: save a checkpoint after the step in which every "
                   "N-th pass over the training samples ends (0: never)",
                   "N")),
           0);
  at_least(add(opt("keep-last-n-checkpoints", Kind::Int, int64_t{0},
                   "delete older checkpoints, keeping N (0: keep all)", "N")),
           0);
  add(opt("resume", Kind::Text, {},
          "continue from a checkpoint file, the one written last in a folder, or latest (in "
          "--output-dir); auto: latest if there is one, else start afresh, and exit 0 if that "
          "run is finished (the same command for every start of a job); empty: start afresh",
          "PATH|DIR|latest|auto"));
  add(opt("save-model", Kind::Text, {},
          "write the trained parameters to this file (PATH.safetensors: in safetensors; empty: do "
          "not)",
          "PATH"));
  choices(add(opt("save-model-at", Kind::Choice, std::string("last"),
                  "which parameters --save-model holds: those after the last step, or those of "
                  "the evaluation with the lowest loss (best: written when reached; needs "
                  "--eval-every)",
                  "last|best")),
          {"last", "best"});
  choices(add(opt("save-precision", Kind::Choice, std::string("same"),
                  "the float type of --save-model's tensors: those the run trained in (same), or "
                  "converted (integer tensors stay as they are)",
                  "same|float32|fp16|bf16")),
          {"same", "float32", "fp16", "bf16"});
  return v;
}

std::string option_names_hint(const std::string& word) {
  std::vector<std::string> names;
  for (const auto& s : option_specs()) names.push_back("--" + s.name);
  return did_you_mean(word, names);
}

std::string value_text(const OptValue& v) {
  if (auto* b = std::get_if<bool>(&v)) return *b ? "true" : "false";
  if (auto* i = std::get_if<int64_t>(&v)) return std::to_string(*i);
  if (auto* d = std::get_if<double>(&v)) return format_real(*d);
  if (auto* s = std::get_if<std::string>(&v)) return s->empty() ? "\"\"" : *s;
  const auto& list = std::get<std::vector<std::string>>(v);
  std::string out;
  for (const auto& s : list) out += (out.empty() ? "" : " ") + s;
  return out.empty() ? "(none)" : out;
}

}  // namespace

const std::vector<OptionSpec>& option_specs() {
  static const std::vector<OptionSpec> specs = build_specs();
  return specs;
}

const OptionSpec* find_option(const std::string& name) {
  for (const auto& s : option_specs())
    if (s.name == name) return &s;
  return nullptr;
}

std::string snake(const std::string& k) {
  std::string s = k;
  std::replace(s.begin(), s.end(), '-', '_');
  return s;
}

std::string kebab(const std::string& s) {
  std::string k = s;
  std::replace(k.begin(), k.end(), '_', '-');
  return k;
}

bool is_config_key(const OptionSpec& spec) {
  return spec.kind != Kind::Action && spec.kind != Kind::ActionArg && spec.name != "optimizer-args";
}

void Layer::remove_overridden(const Layer& upper) {
  for (const auto& kv : upper.values) values.erase(kv.first);
  for (const auto& kv : upper.optimizer_args) optimizer_args.erase(kv.first);
  // Two settings can be given two ways each: a layer naming one way replaces both below it.
  if (upper.values.count("optimizer") || upper.values.count("optimizer-plugin")) {
    values.erase("optimizer");
    values.erase("optimizer-plugin");
  }
  if (upper.values.count("learning-rate")) optimizer_args.erase("lr");
  if (upper.optimizer_args.count("lr")) values.erase("learning-rate");
}

void Layer::overlay(const Layer& other) {
  remove_overridden(other);
  for (const auto& [k, v] : other.values) values[k] = v;
  for (const auto& [k, v] : other.optimizer_args) optimizer_args[k] = v;
}

Layer default_layer() {
  Layer l;
  for (const auto& s : option_specs())
    if (s.def && is_config_key(s)) l.values[s.name] = Setting{*s.def, ""};
  return l;
}

std::string origin_label(const std::string& name, const std::string& where) {
  if (where.empty() || where.rfind("--", 0) == 0) return "--" + name;
  return where + ": " + snake(name);
}

void check_value(const OptionSpec& spec, const Setting& s) {
  const std::string label = origin_label(spec.name, s.where);
  if (spec.kind == Kind::Choice) {
    const auto& v = std::get<std::string>(s.value);
    if (std::find(spec.choices.begin(), spec.choices.end(), v) == spec.choices.end()) {
      std::string list;
      for (const auto& c : spec.choices) list += (list.empty() ? "" : ", ") + c;
      throw Error(label + ": '" + v + "' is not one of " + list + did_you_mean(v, spec.choices));
    }
  }
  double number = 0;
  if (auto* i = std::get_if<int64_t>(&s.value))
    number = static_cast<double>(*i);
  else if (auto* d = std::get_if<double>(&s.value))
    number = *d;
  else
    return;
  auto bound = [&](double b) {
    return spec.kind == Kind::Int ? std::to_string(static_cast<int64_t>(b)) : format_real(b);
  };
  if (std::isnan(number)) throw Error(label + ": is not a number (nan)");
  if (std::isinf(number)) throw Error(label + ": must be finite, got " + value_text(s.value));
  if (spec.min_open ? !(number > spec.min) : number < spec.min)
    throw Error(label + (spec.min_open ? ": must be greater than " : ": must be at least ") +
                bound(spec.min) + ", got " + value_text(s.value));
  if (number > spec.max)
    throw Error(label + ": must be at most " + bound(spec.max) + ", got " + value_text(s.value));
}

// True when `s` is well-formed UTF-8 (no overlongs, surrogates or code points past U+10FFFF).
bool valid_utf8(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    const size_t n = c < 0x80           ? 1
                     : (c >> 5) == 0x6  ? 2
                     : (c >> 4) == 0xe  ? 3
                     : (c >> 3) == 0x1e ? 4
                                        : 0;
    if (n == 0 || i + n > s.size()) return false;
    uint32_t cp = n == 1 ? c : c & (0x7f >> n);
    for (size_t k = 1; k < n; ++k) {
      const unsigned char cc = static_cast<unsigned char>(s[i + k]);
      if ((cc >> 6) != 0x2) return false;
      cp = (cp << 6) | (cc & 0x3f);
    }
    static const uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMin[n] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return false;
    i += n;
  }
  return true;
}

OptValue parse_cli_value(const OptionSpec& spec, const std::string& text) {
  const std::string label = "--" + spec.name;
  // Values end up in TOML (--print-config, the config saved in checkpoints), which is UTF-8.
  if (!valid_utf8(text))
    throw Error(label + ": the value is not valid UTF-8 text (rename the file or folder)");
  switch (spec.kind) {
    case Kind::Flag:
      if (text == "true" || text == "1" || text == "yes") return true;
      if (text == "false" || text == "0" || text == "no") return false;
      throw Error(label + ": '" + text + "' is not true or false");
    case Kind::Int: {
      int64_t i;
      if (!parse_integer(text, i)) throw Error(label + ": '" + text + "' is not an integer");
      return i;
    }
    case Kind::Real: {
      double d;
      if (!parse_real(text, d)) throw Error(label + ": '" + text + "' is not a number");
      return d;
    }
    case Kind::TextList:
      return std::vector<std::string>{text};
    default:
      return text;
  }
}

std::string format_real(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, v);
  std::string s(buf, r.ptr);
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
  return s;
}

CommandLine parse_command_line(const std::vector<std::string>& args) {
  po::options_description desc;
  for (const auto& s : option_specs()) {
    const char* name = s.name.c_str();
    switch (s.kind) {
      case Kind::Action:
        if (s.name == "help")
          desc.add_options()("help,h", po::bool_switch(), "");
        else
          desc.add_options()(name, po::bool_switch(), "");
        break;
      case Kind::Flag:
        desc.add_options()(name, po::value<std::string>()->implicit_value("true"), "");
        break;
      case Kind::TextList:
        if (s.name == "optimizer-args" || s.name == "lr-scale" || s.name == "no-weight-decay" ||
            s.name == "freeze")
          desc.add_options()(name, po::value<std::vector<std::string>>()->multitoken(), "");
        else
          desc.add_options()(name, po::value<std::vector<std::string>>(), "");
        break;
      default:
        desc.add_options()(name, po::value<std::string>(), "");
    }
  }
  po::parsed_options parsed(&desc);
  try {
    const int style = po::command_line_style::unix_style & ~po::command_line_style::allow_guessing;
    parsed = po::command_line_parser(args).options(desc).style(style).run();
  } catch (const po::unknown_option& e) {
    const std::string bad = e.get_option_name();
    std::string word = bad.substr(0, bad.find('='));
    if (word.empty() || word == "--") {  // a stray word, which Boost reports as a nameless option
      for (const auto& a : args)
        if (!a.empty() && a[0] != '-')
          throw Error("unexpected argument '" + a +
                      "': options start with -- (see trainer --help)");
    }
    throw Error("unknown option '" + word + "'" + option_names_hint(word) + "; see trainer --help");
  } catch (const po::too_many_positional_options_error&) {
    std::string first;
    for (const auto& a : args)
      if (!a.empty() && a[0] != '-') {
        first = a;
        break;
      }
    throw Error("unexpected argument '" + first + "': options start with -- (see trainer --help)");
  } catch (const po::error& e) {
    throw Error(std::string("command line: ") + e.what());
  }

  CommandLine cl;
  std::map<std::string, bool> list_started;
  for (const auto& o : parsed.options) {
    if (o.string_key.empty() || o.position_key >= 0)
      throw Error("unexpected argument '" + (o.value.empty() ? std::string() : o.value.front()) +
                  "': options start with -- (see trainer --help)");
    std::string name = o.string_key == "h" ? "help" : o.string_key;
    const OptionSpec* spec = find_option(name);
    if (!spec) throw Error("unknown option '--" + name + "'" + option_names_hint("--" + name));
    const std::string label = "--" + name;
    switch (spec->kind) {
      case Kind::Action:
        if (name == "help") cl.help = true;
        if (name == "version") cl.version = true;
        if (name == "list-plugins") cl.list_plugins = true;
        if (name == "print-config") cl.print_config = true;
        if (name == "list-params") cl.list_params = true;
        if (name == "check-data") cl.check_data = true;
        break;
      case Kind::ActionArg: {
        const std::string v = o.value.empty() ? "" : o.value.front();
        if (v.empty()) throw Error(label + ": needs a value");
        if (name == "config") cl.config = v;
        if (name == "describe-plugin") cl.describe_plugin = v;
        if (name == "run") cl.runs.push_back(v);
        break;
      }
      case Kind::TextList:
        if (name == "optimizer-args") {
          if (o.value.empty()) throw Error(label + ": needs at least one key=value");
          for (const auto& token : o.value) {
            size_t eq = token.find('=');
            if (eq == std::string::npos || eq == 0)
              throw Error(label + ": '" + token + "' is not key=value");
            UserArg a;
            a.text = token.substr(eq + 1);
            a.where = label;
            if (a.text.empty()) throw Error(label + ": '" + token + "' has no value");
            // The later of two would win unseen, as a typo in a long command often does.
            const std::string key = token.substr(0, eq);
            if (const auto seen = cl.layer.optimizer_args.find(key);
                seen != cl.layer.optimizer_args.end())
              throw Error(label + ": '" + key + "' is given twice (" + seen->second.text + " and " +
                          a.text + "); give it once");
            cl.layer.optimizer_args[key] = a;
          }
        } else {
          // Repeated occurrences accumulate; the command line replaces the config's list.
          auto& setting = cl.layer.values[name];
          if (!list_started[name]) setting = Setting{std::vector<std::string>{}, label};
          list_started[name] = true;
          for (const auto& token : o.value)
            std::get<std::vector<std::string>>(setting.value).push_back(token);
        }
        break;
      default: {
        // A flag without "=value" is true (Boost leaves implicit values out of the tokens).
        if (o.value.empty() && spec->kind != Kind::Flag) throw Error(label + ": needs a value");
        Setting s{parse_cli_value(*spec, o.value.empty() ? "true" : o.value.back()), label};
        check_value(*spec, s);
        cl.layer.values[name] = s;  // the last occurrence wins
      }
    }
  }
  return cl;
}

std::string help_text() {
  std::ostringstream o;
  o << "Usage: trainer [--config FILE] [options]\n"
    << "Trains a model with an optimizer plugin, optionally fusing the optimizer step into the\n"
    << "backward pass. Every option can also be set in the TOML config under its snake_case\n"
    << "name (--max-train-steps -> max_train_steps); the command line overrides the config.\n";
  std::string section;
  for (const auto& s : option_specs()) {
    if (s.section != section) {
      section = s.section;
      o << "\n" << section << ":\n";
    }
    std::string left = "  --" + s.name;
    if (s.name == "help") left = "  -h, --help";
    if (s.kind == Kind::Flag)
      left += "[=true|false]";
    else if (s.kind != Kind::Action)
      left += " " + (s.metavar.empty() ? std::string("VALUE") : s.metavar);
    o << left;
    if (left.size() < 40)
      o << std::string(40 - left.size(), ' ');
    else
      o << "\n" << std::string(40, ' ');
    o << s.help;
    if (s.kind == Kind::Choice) {
      std::string list;
      for (const auto& c : s.choices) list += (list.empty() ? "" : ", ") + c;
      if (s.metavar.find('|') == std::string::npos) o << " (" << list << ")";
    }
    if (s.kind != Kind::Action && s.kind != Kind::ActionArg) {
      if (s.def)
        o << " [default: " << value_text(*s.def) << "]";
      else if (s.kind != Kind::TextList)
        o << " [default: unset]";
    }
    o << "\n";
  }
  o << "\nExit status: 0 success, 2 configuration or usage error, 3 training failed,\n"
    << "1 unexpected internal error. Errors are one line on stderr.\n";
  return o.str();
}

}  // namespace fusebox::trainer
