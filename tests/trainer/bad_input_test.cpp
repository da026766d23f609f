// Bad input through the real trainer program: each case exits non-zero (never by a signal), prints
// exactly one line on stderr naming the culprit, and leaves nothing in the output folder.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <fstream>
#include <sstream>
#include <streambuf>
#include <vector>

#include <caffe2/serialize/inline_container.h>

#include "fusebox/core/safetensors.h"
#include "trainer_test_util.h"

namespace fs = std::filesystem;
using namespace fusebox::trainer::testing;

namespace {

struct BadCase {
  std::string name;
  std::string args;      // {dir} is replaced by the case's folder
  std::string fragment;  // must appear in the error line
  int code;              // expected exit code
};

std::string replace_all(std::string s, const std::string& from, const std::string& to) {
  for (size_t p = s.find(from); p != std::string::npos; p = s.find(from, p + to.size()))
    s.replace(p, from.size(), to);
  return s;
}

// A TorchScript archive whose pickles pop an empty stack: LibTorch's reader dies of SIGSEGV.
void write_malformed_script(const std::string& path) {
  caffe2::serialize::PyTorchStreamWriter writer(path);
  const std::string constants = "\x80\x02R.", data = "\x80\x02}.";
  writer.writeRecord("constants.pkl", constants.data(), constants.size());
  writer.writeRecord("data.pkl", data.data(), data.size());
  writer.writeEndOfFile();
}

}  // namespace

TEST(TrainerBadInput, EveryCaseIsOneLineNonZeroAndLeavesNoFiles) {
  TempDir tmp;
  const std::string tp = FUSEBOX_TEST_PLUGIN_DIR;
  const std::string small = "--model mlp --model-width 8 --max-train-steps 3 --threads 1 ";
  // Files the cases refer to.
  tmp.write("malformed.toml", "model = [\"mlp\"\nseed = 1\n");
  tmp.write("illtyped.toml", "max_train_steps = \"ten\"\n");
  tmp.write("unknown.toml", "optimizer = \"sgd\"\nlearning_rat = 0.1\n");
  tmp.write("text.so", "definitely not a library\n");
  {
    unsigned char h[64] = {0x7f, 'E', 'L', 'F', 2, 1, 1};
    h[16] = 3;
    h[18] = 183;  // EM_AARCH64
#if defined(__aarch64__)
    h[18] = 62;
#endif
    std::ofstream(tmp.file("arm.so"), std::ios::binary).write(reinterpret_cast<char*>(h), 64);
  }
  tmp.write("corrupt.fbx", "FUSEBOX-CKPT but then garbage");
  tmp.write("a_file", "x");
  ASSERT_EQ(::mkfifo(tmp.file("fifo").c_str(), 0600), 0);
  write_malformed_script(tmp.file("malformed_script.pt"));
  fs::create_symlink(tmp.file("loop2"), tmp.file("loop1"));
  fs::create_symlink(tmp.file("loop1"), tmp.file("loop2"));
  {  // a plugin cut short by an interrupted copy
    std::ifstream in(std::string(FUSEBOX_PLUGIN_DIR) + "/sgd.so", std::ios::binary);
    std::string head(5000, '\0');
    in.read(head.data(), static_cast<std::streamsize>(head.size()));
    std::ofstream(tmp.file("cut.so"), std::ios::binary) << head;
  }
  std::ofstream(tmp.file("huge.toml")).seekp((17 << 20) - 1) << '\n';
  // Weights written by --save-model: a dict of tensors, not a module.
  ASSERT_EQ(
      run_program("--model mlp --model-width 8 --threads 1 --optimizer sgd --max-train-steps 1 "
                  "--output-dir '' --save-model " +
                      tmp.file("weights.pt"),
                  tmp.str())
          .code,
      0);
  fusebox::save_safetensors({{"w", at::zeros({2})}}, tmp.file("weights.safetensors"));
  // A safetensors file whose header claims data past its end.
  std::string cut = fusebox::encode_safetensors({{"w", at::zeros({64})}});
  std::ofstream(tmp.file("cut.safetensors"), std::ios::binary) << cut.substr(0, cut.size() - 8);

  const std::vector<BadCase> cases{
      {"malformed toml", "--config {dir}/malformed.toml", "malformed.toml:", 2},
      {"ill-typed key", "--config {dir}/illtyped.toml", "max_train_steps", 2},
      {"unknown key", "--config {dir}/unknown.toml", "did you mean 'learning_rate'", 2},
      {"unknown flag", "--optimizer sgd --fused-backwards-pass", "--fused-backward-pass", 2},
      {"out of range", "--optimizer sgd --train-batch-size 0", "--train-batch-size", 2},
      {"fused + groups", "--optimizer sgd --fused-backward-pass --fused-optimizer-groups 2",
       "--fused-optimizer-groups", 2},
      {"fused + accumulation",
       "--optimizer sgd --fused-backward-pass --gradient-accumulation-steps 2",
       "--gradient-accumulation-steps", 2},
      {"fp16 + fused without a loss scale",
       "--optimizer sgd --mixed-precision fp16 --fused-backward-pass",
       "--mixed-precision: fp16 with --fused-backward-pass needs a loss scale chosen with "
       "--loss-scale",
       2},
      {"dynamic loss scale + groups",
       "--optimizer sgd --loss-scale dynamic --fused-optimizer-groups 2",
       "--loss-scale: dynamic cannot be used with --fused-optimizer-groups", 2},
      {"loss scale beyond float", "--optimizer sgd --loss-scale-value 1e39", "--loss-scale-value",
       2},
      {"denoiser deeper than its image halves",
       "--optimizer sgd --model denoiser --model-depth 25 --image-size 1048576",
       "--image-size: 1048576 must be divisible by 16777216", 2},
      {"dynamic loss scale below its minimum",
       "--optimizer sgd --loss-scale dynamic --loss-scale-value 1e-6",
       "--loss-scale-value: a dynamic scale must start at 2^-16", 2},
      {"groups + auto-LR", "--optimizer prodigy --fused-optimizer-groups 2",
       "cannot be used with prodigy", 2},
      {"fused without step_param",
       "--optimizer-plugin " + tp + "/tp_no_step_param.so --fused-backward-pass",
       "does not declare supports_step_param", 2},
      {"missing plugin", "--optimizer-plugin /nonexistent/x.so", "does not exist", 2},
      {"text file named .so", "--optimizer-plugin {dir}/text.so", "is not a shared library", 2},
      {"foreign ELF", "--optimizer-plugin {dir}/arm.so", "built for another architecture", 2},
      {"no entry point", "--optimizer-plugin " + tp + "/tp_no_entry.so",
       "has no fusebox_plugin_entry", 2},
      {"ABI mismatch", "--optimizer-plugin " + tp + "/tp_api_major.so", "uses plugin API 3.0", 2},
      {"factory throws", "--optimizer-plugin " + tp + "/tp_factory_throws.so",
       "factory refuses to build", 2},
      {"step_param throws",
       "--optimizer-plugin " + tp + "/tp_step_param_throws.so --fused-backward-pass",
       "step_param exploded on purpose", 3},
      {"step throws", "--optimizer-plugin " + tp + "/tp_step_throws.so", "step exploded", 3},
      {"plugin throws an int", "--optimizer-plugin " + tp + "/tp_throws_int.so",
       "the optimizer throws_int threw a value that is not a std::exception", 3},
      {"plugin throws an int in a hook",
       "--fused-backward-pass --optimizer-plugin " + tp + "/tp_throws_int.so",
       "threw a value that is not a std::exception (a bug in the plugin", 3},
      {"a schedule adafactor's relative step would ignore",
       "--optimizer adafactor --lr-scheduler cosine",
       "--lr-scheduler cosine: adafactor with relative_step=true computes its own step size", 2},
      {"polynomial decay below its end",
       "--optimizer sgd --lr-scheduler polynomial "
       "--learning-rate 1e-8",
       "polynomial decays to 1e-07", 2},
      {"plugin of the other string ABI", "--optimizer-plugin " + tp + "/tp_other_string_abi.so",
       "is built with -D_GLIBCXX_USE_CXX11_ABI=0", 2},
      {"bad hyperparameter", "--optimizer adamw --optimizer-args betas=\'(0.9,1.5)\'", "'betas'",
       2},
      {"unknown hyperparameter", "--optimizer adamw --optimizer-args beta=0.9",
       "did you mean 'betas'", 2},
      {"missing dataset", "--optimizer sgd --model transformer --dataset text:/nonexistent/t.txt",
       "/nonexistent/t.txt", 2},
      {"missing model script", "--optimizer sgd --model-script /nonexistent/m.pt",
       "/nonexistent/m.pt", 2},
      {"unwritable output", "--optimizer sgd --output-dir {dir}/a_file/out", "a_file", 2},
      {"corrupt checkpoint", "--optimizer sgd --resume {dir}/corrupt.fbx", "corrupt.fbx", 2},
      {"NaN loss", "--optimizer sgd --learning-rate 1e6 --max-train-steps 40", "non-finite", 3},
      {"save-model is a folder", "--optimizer sgd --save-model {dir}/", "is a folder", 2},
      {"infinite hyperparameter", "--optimizer sgd --optimizer-args lr=inf",
       "'lr': inf is outside (0, inf)", 2},
      {"nan option", "--optimizer sgd --learning-rate nan", "is not a number (nan)", 2},
      {"a line break in a path", "--optimizer sgd --model-script '{dir}/no\nsuch.pt'",
       "no\\nsuch.pt does not exist", 2},
      {"malformed TorchScript", "--optimizer sgd --model-script {dir}/malformed_script.pt",
       "malformed_script.pt cannot be loaded: ", 2},
      {"a symlink loop", "--optimizer sgd --model-script {dir}/loop1",
       "loop1 cannot be reached (Too many levels of symbolic links)", 2},
      {"lr past float", "--optimizer sgd --learning-rate 1e39", "--learning-rate: must be at most",
       2},
      {"too many threads", "--optimizer sgd --threads 5000000000", "must be at most 1024", 2},
      {"a seed past 32 bits", "--optimizer sgd --seed 4294967296",
       "--seed: must be at most 4294967295", 2},
      {"infinite timeout", "--optimizer sgd --dist-timeout inf", "must be finite", 2},
      {"model too large", "--optimizer sgd --model-width 10000000", "cannot build the mlp model",
       2},
      {"model past int64 bytes", "--optimizer sgd --model-width 99999999999",
       "parameters need 69388.9 EiB in float32", 2},
      {"attention past memory", "--optimizer sgd --model transformer --seq-len 1000000",
       "one block's attention scores (8 sequences x 4 heads x 1000000^2) need 116.4 TiB", 2},
      {"unknown eval dataset", "--optimizer sgd --eval-every 1 --eval-dataset bogus",
       "--eval-dataset: 'bogus' is not synthetic, none, text:PATH or tensors:PATH", 2},
      {"eval text for the mlp", "--optimizer sgd --eval-dataset text:{dir}/malformed_script.pt",
       "--eval-dataset: text data is for the transformer model, not mlp", 2},
      {"eval every -1", "--optimizer sgd --eval-every -1", "--eval-every", 2},
      {"best model without a model file", "--optimizer sgd --eval-every 1 --save-model-at best",
       "--save-model-at: best chooses what --save-model holds, and --save-model is unset", 2},
      {"best model without evaluations",
       "--optimizer sgd --save-model-at best --save-model {dir}/m.pt",
       "--save-model-at: best keeps the parameters of the best evaluation, and there are none; "
       "give --eval-every N",
       2},
      {"early stop without evaluations", "--optimizer sgd --early-stop-patience 2",
       "--early-stop-patience: counts evaluations, and there are none; give --eval-every N", 2},
      {"holdout of synthetic data", "--optimizer sgd --eval-holdout 0.1",
       "--eval-holdout: holds out the end of a text or tensors file, but --dataset is synthetic",
       2},
      {"holdout of over half", "--optimizer sgd --eval-holdout 0.6",
       "--eval-holdout: must be at most 0.5, got 0.6", 2},
      {"holdout of nothing", "--optimizer sgd --eval-holdout 0",
       "--eval-holdout: must be greater than 0", 2},
      {"checkpointing a script model",
       "--optimizer sgd --gradient-checkpointing --model-script {dir}/malformed_script.pt",
       "--gradient-checkpointing: works with the built-in models only", 2},
      {"batch over ranks", "--optimizer sgd --nproc-per-node 2 --train-batch-size 3",
       "cannot be split evenly over 2 ranks", 2},
      {"not UTF-8", "--optimizer sgd --output-dir {dir}/\xff", "not valid UTF-8", 2},
      {"config is a pipe", "--config {dir}/fifo",
       "config file " + tmp.file("fifo") + " is not a regular file", 2},
      {"config is a device", "--config /dev/zero", "config file /dev/zero is not a regular file",
       2},
      {"config far too large", "--config {dir}/huge.toml", "huge.toml is 17 MiB", 2},
      {"save-model is a device", "--optimizer sgd --save-model /dev/full",
       "--save-model: /dev/full exists and is not a regular file", 2},
      {"save-model over the run's summary",
       "--optimizer sgd --output-dir {dir}/own --save-model {dir}/own/summary.json",
       "is a file the run itself writes in --output-dir", 2},
      {"save-model over a checkpoint",
       "--optimizer sgd --output-dir {dir}/own --save-model {dir}/own/checkpoint-00000003.fbx",
       "give the model another name", 2},
      {"save-model below a file", "--optimizer sgd --save-model {dir}/a_file/model.pt",
       "a_file is not a folder", 2},
      {"truncated plugin", "--optimizer-plugin {dir}/cut.so", "cut.so is truncated", 2},
      {"dataset is a pipe", "--optimizer sgd --model transformer --dataset text:{dir}/fifo",
       "is not a regular file", 2},
      {"weights file as model script", "--optimizer sgd --model-script {dir}/weights.pt",
       "cannot be loaded: it holds model weights (a --save-model, torch.save or safetensors "
       "file)",
       2},
      {"safetensors file as model script",
       "--optimizer sgd --model-script {dir}/weights.safetensors",
       "cannot be loaded: it holds model weights (a --save-model, torch.save or safetensors "
       "file)",
       2},
      {"cut safetensors as initial weights", "--optimizer sgd --init-weights {dir}/cut.safetensors",
       "data_offsets [0, 256] are not inside the 248 bytes of data (a truncated file?)", 2},
      {"foreign weights as initial weights",
       "--optimizer sgd --init-weights {dir}/weights.safetensors",
       "weights.safetensors holds 'w', which this model has no parameter or buffer of", 2},
      {"weights as training data", "--optimizer sgd --dataset tensors:{dir}/weights.safetensors",
       "weights.safetensors holds 'w'; the mlp reads 'input' [samples, 8] (--model-width) and "
       "'target' [samples, 1]",
       2},
      {"cut safetensors as training data",
       "--optimizer sgd --dataset tensors:{dir}/cut.safetensors", "--dataset tensors:", 2},
      {"a TorchScript module as evaluation data",
       "--optimizer sgd --eval-every 1 --eval-dataset tensors:{dir}/malformed_script.pt",
       "--eval-dataset tensors:", 2},
      {"a missing tensors file", "--optimizer sgd --dataset tensors:{dir}/none.safetensors",
       "--dataset: tensors file", 2},
  };
  int i = 0;
  for (const BadCase& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string out = tmp.file("out" + std::to_string(i++));
    std::string args = replace_all(c.args, "{dir}", tmp.str());
    if (args.find("--output-dir") == std::string::npos) args += " --output-dir " + out;
    if (args.find("--config") == std::string::npos) args = small + args;
    const auto r = run_program(args, tmp.str());
    EXPECT_EQ(r.code, c.code) << r.err;  // -1 would mean killed by a signal
    EXPECT_EQ(count_lines(r.err), 1) << r.err;
    EXPECT_EQ(r.err.rfind("trainer: error: ", 0), 0u) << r.err;
    EXPECT_NE(r.err.find(c.fragment), std::string::npos) << r.err;
    std::error_code ec;
    if (fs::exists(out, ec)) {
      EXPECT_TRUE(fs::is_empty(out, ec)) << "files left in " << out;
    }
  }
}

namespace {

// Records every piece an ostream hands to its buffer: each piece is one write(2) on an
// unbuffered stderr, and the ranks of a data-parallel job share that stderr.
class PieceRecorder : public std::streambuf {
 public:
  std::vector<std::string> pieces;

 protected:
  std::streamsize xsputn(const char* s, std::streamsize n) override {
    pieces.emplace_back(s, static_cast<size_t>(n));
    return n;
  }
  int_type overflow(int_type c) override {
    if (c != traits_type::eof()) pieces.emplace_back(1, traits_type::to_char_type(c));
    return c;
  }
};

}  // namespace

// An error line written piece by piece interleaves with another rank's ("trainer: error: trainer:
// error: rank 1: rank 0: ..."): it must go out whole.
TEST(TrainerErrors, AnErrorLineIsWrittenInOnePiece) {
  PieceRecorder recorder;
  std::ostream err(&recorder);
  std::ostringstream out;
  const int code = fusebox::trainer::trainer_main({"--optimizer", "sgd", "--max-train-steps=0"},
                                                  out, err, false);
  EXPECT_EQ(code, 2);
  ASSERT_EQ(recorder.pieces.size(), 1u);
  EXPECT_EQ(recorder.pieces[0], "trainer: error: --max-train-steps: must be at least 1, got 0\n");
}

// The line written when LibTorch's reader crashes on a model script is held to the same rules as
// every other error line: it says which rank of a job it came from, and it is one line per rank.
TEST(TrainerBadInput, AReaderCrashInARankIsOneLineNamingTheRank) {
  TempDir tmp;
  write_malformed_script(tmp.file("bad\nscript.pt"));
  const auto r = run_program("--model-script '" + tmp.file("bad\nscript.pt") +
                                 "' --optimizer sgd --threads 1 --nproc-per-node 2 "
                                 "--dist-timeout 60 --output-dir " +
                                 tmp.file("out"),
                             tmp.str());
  EXPECT_EQ(r.code, 2) << r.err;
  // LibTorch 1.13's reader crashes on the file (the crash guard's line); 2.x refuses it.
  const std::string line = "model script " + tmp.str() + "/bad\\nscript.pt cannot be loaded: ";
  EXPECT_NE(r.err.find("trainer: error: rank 0: " + line), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("trainer: error: rank 1: " + line), std::string::npos) << r.err;
  EXPECT_EQ(count_lines(r.err), 2) << r.err;
}

// [[runs]]: a name is one folder name, and every run is checked before the first one trains.
TEST(TrainerBadInput, RunsAreCheckedBeforeAnyRunTrains) {
  TempDir tmp;
  tmp.write("a_file", "x");
  const std::string head =
      "optimizer = \"sgd\"\nmodel_width = 8\nmax_train_steps = 2\n"
      "threads = 1\noutput_dir = \"" +
      tmp.file("runs") + "\"\n";
  tmp.write("escape.toml", head + "[[runs]]\nname = \"../../escape\"\n");
  auto r = run_program("--config " + tmp.file("escape.toml"), tmp.str());
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(count_lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("escape.toml:7:8: runs.name: '../../escape' may use only letters"),
            std::string::npos)
      << r.err;
  tmp.write("parent.toml", head + "[[runs]]\nname = \"..\"\n");
  r = run_program("--config " + tmp.file("parent.toml"), tmp.str());
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("runs.name: '..' cannot name a run: it names a folder under output_dir, "
                       "and '..' is the folder above it"),
            std::string::npos)
      << r.err;
  tmp.write("late.toml", head + "[[runs]]\nname = \"a\"\n[[runs]]\nname = \"b\"\noutput_dir = \"" +
                             tmp.file("a_file") + "\"\n");
  r = run_program("--config " + tmp.file("late.toml"), tmp.str());
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(count_lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("run 'b': --output-dir: cannot create"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(tmp.file("runs"))) << "run 'a' trained before run 'b' was checked";
  tmp.write("sched.toml", head +
                              "[[runs]]\nname = \"a\"\n[[runs]]\nname = \"b\"\n"
                              "lr_scheduler = \"cosine_with_restarts\"\n"
                              "lr_scheduler_num_cycles = 0\n");
  r = run_program("--config " + tmp.file("sched.toml"), tmp.str());
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("lr_scheduler_num_cycles: must be greater than 0"), std::string::npos)
      << r.err;
  EXPECT_FALSE(fs::exists(tmp.file("runs")));
}

// The command line names the plugin either way over a config that named it the other way.
TEST(TrainerBadInput, CommandLinePluginChoiceOverridesTheConfigs) {
  TempDir tmp;
  tmp.write("adam.toml", "optimizer = \"adam\"\nmodel_width = 8\nmax_train_steps = 1\n");
  auto r =
      run_program("--config " + tmp.file("adam.toml") + " --optimizer-plugin sgd.so --output-dir " +
                      tmp.file("o") + " --print-config",
                  tmp.str());
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("optimizer_plugin = \"sgd.so\""), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("optimizer = \"adam\""), std::string::npos) << r.out;
}

// Training finished but its summary cannot be written (here a folder is in its way; a full disk
// does the same): a failure of the run (3), not of its input (2), and the checkpoint is kept.
TEST(TrainerBadInput, ASummaryThatCannotBeWrittenIsATrainingFailure) {
  TempDir tmp;
  fs::create_directories(tmp.file("out/summary.json"));
  const auto r = run_program(
      "--model mlp --model-width 8 --max-train-steps 3 --threads 1 --optimizer sgd --output-dir " +
          tmp.file("out"),
      tmp.str());
  EXPECT_EQ(r.code, 3) << r.err;
  EXPECT_EQ(count_lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("cannot write " + tmp.file("out/summary.json")), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("training finished; its checkpoints are in " + tmp.file("out")),
            std::string::npos)
      << r.err;
  EXPECT_TRUE(fs::is_regular_file(tmp.file("out/checkpoint-00000003.fbx")));
}
