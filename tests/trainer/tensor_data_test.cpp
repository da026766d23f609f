// --dataset tensors:PATH: samples of the user's own, walked through epoch by epoch in a shuffled
// order; what each model reads from the file; the held-out part; resuming mid-epoch; a script
// model's forward arguments by name; the refusals.
#include <gtest/gtest.h>
#include <torch/script.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <regex>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "../error_of.h"
#include "checkpoint.h"
#include "config.h"
#include "data.h"
#include "fusebox/core/checkpoint.h"
#include "fusebox/core/memory_tracker.h"
#include "fusebox/core/safetensors.h"
#include "fusebox/core/zip_archive.h"
#include "fusebox/error.h"
#include "tensor_data.h"
#include "trainer_test_util.h"

namespace fusebox::trainer {
namespace {

using ::fusebox::testing::error_of;
using testing::join;
using testing::losses;
using testing::Result;
using testing::run_trainer;
using testing::TempDir;
using testing::two_step_epochs_run;
using Named = std::vector<std::pair<std::string, at::Tensor>>;

// Ten samples whose 'target' is the sample's number and whose 'input' row is [2n, 2n + 1].
Named numbered(int64_t n = 10) {
  return {{"input", at::arange(2 * n, at::kFloat).reshape({n, 2})},
          {"target", at::arange(n, at::kFloat)}};
}

TrainConfig mlp_config(const std::string& path, int64_t batch = 4) {
  TrainConfig c;
  c.model = "mlp", c.model_width = 2, c.train_batch_size = batch, c.seed = 5;
  c.dataset = c.eval_dataset = "tensors";
  c.dataset_path = c.eval_dataset_path = path;
  return c;
}

// The sample numbers of `batches` batches of a DataSource or EvalData, checking each row's input
// against its target.
template <class Stream>
std::vector<int64_t> samples_of(Stream& data, int batches) {
  std::vector<int64_t> out;
  for (int i = 0; i < batches; ++i) {
    const Batch b = data.next();
    EXPECT_EQ(b.target.sizes(), (at::IntArrayRef{b.input.size(0), 1}));
    for (int64_t r = 0; r < b.input.size(0); ++r) {
      const auto n = static_cast<int64_t>(b.target[r][0].item<float>());
      EXPECT_EQ(b.input[r][0].item<float>(), 2.0f * static_cast<float>(n));
      out.push_back(n);
    }
  }
  return out;
}

std::vector<int64_t> sorted(std::vector<int64_t> v) {
  std::sort(v.begin(), v.end());
  return v;
}

std::vector<int64_t> range(int64_t from, int64_t to) {
  std::vector<int64_t> v(static_cast<size_t>(to - from));
  std::iota(v.begin(), v.end(), from);
  return v;
}

// Every epoch is every sample once, in an order of its own; a batch that crosses an epoch's end
// continues with the next epoch; the same seed gives the same stream, another seed another.
TEST(TrainerTensorData, EachEpochSeesEverySampleOnceInANewOrder) {
  TempDir tmp;
  save_safetensors(numbered(), tmp.file("d.safetensors"));
  TrainConfig c = mlp_config(tmp.file("d.safetensors"));
  std::unique_ptr<DataSource> data = make_data(c);
  const std::vector<int64_t> seen = samples_of(*data, 5);  // 20 samples: two epochs
  ASSERT_EQ(seen.size(), 20u);
  const std::vector<int64_t> first(seen.begin(), seen.begin() + 10),
      second(seen.begin() + 10, seen.end());
  EXPECT_EQ(sorted(first), range(0, 10));
  EXPECT_EQ(sorted(second), range(0, 10));
  EXPECT_NE(first, second);
  EXPECT_NE(first, range(0, 10));  // shuffled
  EXPECT_EQ(data->samples_drawn(), 20);
  EXPECT_EQ(samples_of(*make_data(c), 5), seen);
  c.seed = 6;
  EXPECT_NE(samples_of(*make_data(c), 5), seen);
  EXPECT_EQ(data->describe(), "tensors " + c.dataset_path +
                                  " (10 samples: input [2] Float, target [] Float; shuffled each "
                                  "epoch)");
}

// A stream told how many samples were drawn continues as the stream that drew them (what a
// checkpoint's data_samples counter restores).
TEST(TrainerTensorData, AStreamContinuesFromTheSamplesDrawn) {
  TempDir tmp;
  save_safetensors(numbered(), tmp.file("d.safetensors"));
  const TrainConfig c = mlp_config(tmp.file("d.safetensors"), 3);
  const std::vector<int64_t> whole = samples_of(*make_data(c), 8);
  std::unique_ptr<DataSource> resumed = make_data(c);
  resumed->set_samples_drawn(12);  // mid-way through the second epoch
  EXPECT_EQ(samples_of(*resumed, 4), std::vector<int64_t>(whole.begin() + 12, whole.end()));
}

// --eval-holdout: the last fifth of the samples is the evaluation's alone; each evaluation sees
// the same batches.
TEST(TrainerTensorData, AHoldoutKeepsTheLastSamplesFromTraining) {
  TempDir tmp;
  save_safetensors(numbered(), tmp.file("d.safetensors"));
  TrainConfig c = mlp_config(tmp.file("d.safetensors"));
  c.eval_holdout = 0.2;
  std::unique_ptr<DataSource> train = make_data(c);
  EvalData eval(c);
  auto set_of = [](const std::vector<int64_t>& v) { return std::set<int64_t>(v.begin(), v.end()); };
  const std::vector<int64_t> trained = samples_of(*train, 20);
  EXPECT_EQ(set_of(trained), set_of(range(0, 8)));
  const std::vector<int64_t> evaluated = samples_of(eval, 3);
  EXPECT_EQ(set_of(evaluated), set_of(range(8, 10)));
  eval.rewind();
  EXPECT_EQ(samples_of(eval, 3), evaluated);
  EXPECT_EQ(train->describe(), "tensors " + c.dataset_path +
                                   " (the first 8 of 10 samples, 2 held out: input [2] Float, "
                                   "target [] Float; shuffled each epoch)");
  c.eval_holdout = 0.05;
  EXPECT_EQ(error_of([&] { EvalData none(c); }),
            "--eval-dataset tensors:" + c.dataset_path +
                " (10 samples): --eval-holdout 0.05 leaves no sample for evaluation (hold out "
                "more, or give more samples)");
}

// A one-dimensional tensor of token ids is a stream for the transformer: its samples are windows
// of --seq-len + 1 ids starting every --seq-len ids (a view, not a copy), the ids after the last
// whole window left out; epochs, holdout and --max-train-epochs count windows.
TEST(TrainerTensorData, ATokenStreamIsReadAsWindows) {
  TempDir tmp;
  save_safetensors({{"ids", at::arange(43, at::kInt)}}, tmp.file("s.safetensors"));
  TrainConfig c = mlp_config(tmp.file("s.safetensors"), 5);
  c.model = "transformer", c.seq_len = 8, c.vocab_size = 64;
  std::unique_ptr<DataSource> data = make_data(c);
  const Batch b = data->next();  // one epoch: the 5 windows of (43 - 1) / 8
  ASSERT_EQ(b.input.sizes(), (at::IntArrayRef{5, 8}));
  EXPECT_TRUE(at::equal(b.target, b.input + 1));
  std::set<int64_t> starts;
  for (int64_t r = 0; r < 5; ++r) starts.insert(b.input[r][0].item<int64_t>());
  EXPECT_EQ(starts, (std::set<int64_t>{0, 8, 16, 24, 32}));  // ids 41 and 42 left out
  EXPECT_NE(data->describe().find("(5 samples: ids [9] Int, windows of a stream of 43 ids; "),
            std::string::npos)
      << data->describe();

  c.eval_holdout = 0.2, c.train_batch_size = 1;
  EvalData eval(c);
  ASSERT_EQ(eval.pass_batches(), 1);
  EXPECT_EQ(eval.pass_batch(0).input[0][0].item<int64_t>(), 32);  // the last window held out

  c.max_train_epochs = 3, c.train_batch_size = 2;
  set_steps_from_epochs(c);
  EXPECT_EQ(c.epoch_samples, 4);
  EXPECT_EQ(c.max_train_steps, 6);  // 3 x 4 windows in batches of 2

  c.seq_len = 50;
  EXPECT_EQ(error_of([&] { make_data(c); }),
            "--dataset tensors:" + c.dataset_path +
                ": 'ids' is a stream of 43 token ids; --seq-len 50 needs at least 51 (give "
                "--seq-len 42)");
  c.seq_len = 8, c.vocab_size = 40;
  EXPECT_EQ(error_of([&] { make_data(c); }),
            "--dataset tensors:" + c.dataset_path +
                ": 'ids' holds token id 40, outside --vocab-size 40 (ids 0 to 39)");
}

// Unsigned token ids (numpy's uint16, safetensors' U16) stay in the mapped file and are widened
// batch by batch: the stream takes no memory of its size, and ids above 32767 keep their values.
TEST(TrainerTensorData, AnUnsignedTokenStreamStaysMappedAndIsWidenedPerBatch) {
  TempDir tmp;
  const int64_t n = int64_t{1} << 25;  // 64 MiB of uint16 ids; widened to int32, 128 MiB
  std::string raw(static_cast<size_t>(2 * n), '\0');
  for (int64_t i = 0; i < n; ++i) {
    const auto id = static_cast<uint16_t>((i * 7919) % 60000);
    std::memcpy(&raw[static_cast<size_t>(2 * i)], &id, 2);
  }
  const std::string count = std::to_string(n);
  std::string dict = "{'descr': '<u2', 'fortran_order': False, 'shape': (" + count + ",), }";
  dict += std::string((64 - (10 + dict.size() + 1) % 64) % 64, ' ') + "\n";  // as np.save pads
  const std::string npy =
      std::string("\x93NUMPY\x01\x00", 8) + static_cast<char>(dict.size()) + '\0' + dict + raw;
  std::string header = R"({"ids":{"dtype":"U16","shape":[)" + count + R"(],"data_offsets":[0,)" +
                       std::to_string(2 * n) + "]}}";
  header += std::string((8 - header.size() % 8) % 8, ' ');
  const uint64_t header_bytes = header.size();
  const std::string st =
      std::string(reinterpret_cast<const char*>(&header_bytes), 8) + header + raw;
  raw.clear();
  for (const auto& [name, bytes] :
       {std::pair{"ids.npy", &npy}, std::pair{"ids.safetensors", &st}}) {
    TrainConfig c = mlp_config(tmp.write(name, *bytes), 4);
    c.model = "transformer", c.seq_len = 16, c.vocab_size = 60000;
    memory::install_cpu_tracking();
    const int64_t base = memory::current_bytes();
    memory::reset_peak();
    std::unique_ptr<DataSource> data = make_data(c);
    // The checks go through the ids in pieces: a few pieces' worth, not the widened stream.
    EXPECT_LT(memory::peak_bytes() - base, 32 << 20) << name;
    EXPECT_NE(data->describe().find("ids [17] Int, windows of a stream of " + count + " ids"),
              std::string::npos)
        << data->describe();
    const Batch b = data->pass_batch(1);  // windows 4 to 7, in the file's order
    ASSERT_EQ(b.input.scalar_type(), at::kLong);
    for (int64_t r = 0; r < 4; ++r)
      for (int64_t j = 0; j < 16; ++j)
        ASSERT_EQ(b.input[r][j].item<int64_t>(), ((4 + r) * 16 + j) * 7919 % 60000) << name;
    EXPECT_GT(b.input.max().item<int64_t>(), 32767);
    c.vocab_size = 50000;
    EXPECT_NE(error_of([&] { make_data(c); }).find("holds token id 59"), std::string::npos);
  }
}

// A headerless .bin file (numpy's tofile, nanoGPT's train.bin) is a stream of token ids of
// --token-dtype, named after the file; a folder of them is one stream per file; a zip archive
// named .bin is still a torch.save'd file.
TEST(TrainerTensorData, AHeaderlessBinFileIsAStreamOfTokenIdsOfTokenDtype) {
  TempDir tmp;
  std::string u16, i64;
  for (int64_t i = 0; i < 1000; ++i) {
    const auto a = static_cast<uint16_t>(i * 61 % 20000 + (i % 2) * 40000);
    const int64_t b = i % 50;
    u16.append(reinterpret_cast<const char*>(&a), 2);
    i64.append(reinterpret_cast<const char*>(&b), 8);
  }
  TrainConfig c = mlp_config(tmp.write("train.bin", u16), 4);
  c.model = "transformer", c.seq_len = 8, c.vocab_size = 60000;
  std::unique_ptr<DataSource> data = make_data(c);
  EXPECT_NE(data->describe().find("(124 samples: train [9] Int, windows of a stream of 1000 ids"),
            std::string::npos)
      << data->describe();
  const Batch b = data->pass_batch(0);
  for (int64_t j = 0; j < 8; ++j)
    EXPECT_EQ(b.input[1][j].item<int64_t>(), (8 + j) * 61 % 20000 + ((8 + j) % 2) * 40000);

  c.token_dtype = "int64", c.dataset_path = tmp.write("ids.bin", i64);
  EXPECT_NE(make_data(c)->describe().find("ids [9] Long, windows of a stream of 1000 ids"),
            std::string::npos);
  c.token_dtype = "uint32", c.dataset_path = tmp.file("train.bin");  // two uint16 ids a value
  EXPECT_NE(error_of([&] { make_data(c); }).find("outside --vocab-size 60000"), std::string::npos);
  c.dataset_path = tmp.write("odd.bin", u16 + "x");
  EXPECT_EQ(error_of([&] { make_data(c); }),
            "--dataset tensors:" + c.dataset_path + ": " + c.dataset_path +
                ": a headerless file of uint32 values, and its 2001 bytes are not a whole number "
                "of 4-byte values; give a safetensors file, a .npy or .npz file (np.save, "
                "np.savez), a torch.save'd {name: tensor} dict of samples, or a headerless .bin "
                "file of token ids of --token-dtype");

  std::filesystem::create_directories(tmp.file("shards"));
  tmp.write("shards/a.bin", u16), tmp.write("shards/b.bin", u16);
  c.token_dtype = "uint16", c.dataset_path = tmp.file("shards");
  // A folder's .bin (or .npy) files: one array each, named after the folder.
  EXPECT_NE(make_data(c)->describe().find("(2 files, 248 samples: shards [9] Int, windows of "
                                          "streams of 2000 ids"),
            std::string::npos)
      << make_data(c)->describe();

  save_model_weights(numbered(), tmp.file("torch.bin"));  // pytorch_model.bin's format
  EXPECT_NE(make_data(mlp_config(tmp.file("torch.bin")))->describe().find("10 samples"),
            std::string::npos);
}

// A file's values are read once per process (the evaluation stream does not check them again),
// but a file written anew since, even of the same size, is checked again.
TEST(TrainerTensorData, AFileChangedSinceItWasCheckedIsCheckedAgain) {
  TempDir tmp;
  const std::string path = tmp.file("d.safetensors");
  save_safetensors(numbered(), path);
  TrainConfig c = mlp_config(path);
  c.eval_holdout = 0.2;
  make_data(c);
  EvalData eval(c);  // the same file, already checked
  Named bad = numbered();
  bad[0].second[9][1] = NAN;  // a held-out sample, the same size of file
  save_safetensors(bad, path);
  EXPECT_EQ(error_of([&] { make_data(c); }),
            "--dataset tensors:" + path +
                ": 'input' holds values that are not finite (NaN or Inf): a NaN sample makes the "
                "loss NaN; clean or drop those samples");
}

// Samples numbered from..to-1, as numbered() makes them.
Named numbered_range(int64_t from, int64_t to) {
  return {{"input", at::arange(2 * from, 2 * to, at::kFloat).reshape({to - from, 2})},
          {"target", at::arange(from, to, at::kFloat)}};
}

// A folder is one dataset in shards: its files' samples follow one another in name order
// (other files are left alone), batches gather rows from any of them, a holdout may span two,
// and the files must agree on their tensors.
TEST(TrainerTensorData, AFolderOfFilesIsOneDataset) {
  TempDir tmp;
  const std::string dir = tmp.file("shards");
  std::filesystem::create_directories(dir);
  save_safetensors(numbered_range(0, 3), dir + "/part-0.safetensors");
  save_safetensors(numbered_range(3, 7), dir + "/part-1.safetensors");
  save_safetensors(numbered_range(7, 10), dir + "/part-2.safetensors");
  tmp.write("shards/README.txt", "not data");
  TrainConfig c = mlp_config(dir);
  std::unique_ptr<DataSource> data = make_data(c);
  const std::vector<int64_t> epoch = samples_of(*data, 5);  // each row checked against its number
  EXPECT_EQ(sorted(std::vector<int64_t>(epoch.begin(), epoch.begin() + 10)), range(0, 10));
  EXPECT_NE(data->describe().find("(3 files, 10 samples: input [2] Float, target [] Float;"),
            std::string::npos)
      << data->describe();

  c.eval_holdout = 0.5;  // samples 5 to 9: the end of part-1 and all of part-2
  EvalData eval(c);
  std::vector<int64_t> held;
  for (int64_t i = 0; i < eval.pass_batches(); ++i)
    for (int64_t r = 0; r < eval.pass_batch(i).target.size(0); ++r)
      held.push_back(static_cast<int64_t>(eval.pass_batch(i).target[r][0].item<float>()));
  EXPECT_EQ(held, range(5, 10));
  EXPECT_EQ(sorted(samples_of(*make_data(c), 5)), sorted([] {
              std::vector<int64_t> v;
              for (int e = 0; e < 4; ++e)
                for (int64_t n = 0; n < 5; ++n) v.push_back(n);
              return v;
            }()));  // four epochs of the first five
  c.max_train_epochs = 2;
  set_steps_from_epochs(c);
  EXPECT_EQ(c.epoch_samples, 5);

  // Files that disagree, and a folder without data files.
  save_safetensors({{"input", at::zeros({2, 3})}, {"target", at::zeros({2})}},
                   dir + "/part-3.safetensors");
  c = mlp_config(dir);
  EXPECT_EQ(error_of([&] { make_data(c); }),
            "--dataset tensors:" + dir +
                "/part-3.safetensors: 'input' is [2, 3] Float; the mlp reads 'input' [samples, "
                "2] (--model-width) and 'target' [samples, 1], both floating-point (give "
                "--model-width 3)");
  save_safetensors({{"input", at::zeros({2, 2}, at::kDouble)}, {"target", at::zeros({2})}},
                   dir + "/part-3.safetensors");
  EXPECT_EQ(error_of([&] { make_data(c); }),
            "--dataset tensors:" + dir +
                "/part-3.safetensors: 'input' holds samples [2] Double, and in --dataset "
                "tensors:" +
                dir +
                "/part-0.safetensors [2] Float: every file of a folder holds samples of one "
                "shape and type");
  std::filesystem::remove(dir + "/part-3.safetensors");
  std::filesystem::create_directories(tmp.file("tokens"));
  save_safetensors({{"t", at::zeros({2, 4}, at::kLong)}}, tmp.file("tokens/a.safetensors"));
  save_safetensors({{"ids", at::zeros({2, 4}, at::kLong)}}, tmp.file("tokens/b.safetensors"));
  TrainConfig tokens = mlp_config(tmp.file("tokens"));
  tokens.model = "transformer", tokens.seq_len = 3, tokens.vocab_size = 8;
  EXPECT_EQ(error_of([&] { make_data(tokens); }),
            "--dataset tensors:" + tmp.file("tokens/b.safetensors") +
                " holds 'ids', and --dataset tensors:" + tmp.file("tokens/a.safetensors") +
                " holds 't': every file of a folder holds the same tensors");
  std::filesystem::create_directories(tmp.file("empty"));
  c.dataset_path = tmp.file("empty");
  EXPECT_EQ(
      error_of([&] { make_data(c); }),
      "--dataset tensors:" + tmp.file("empty") +
          " is a folder with no data files (.safetensors, .npy, .npz, .pt, .pth or .bin): give a "
          "file, or a folder of the files of one dataset");

  // Through the trainer (a folder passes the option checks a file does).
  const Result r = run_trainer({"--optimizer", "sgd", "--model-width", "2", "--dataset",
                                "tensors:" + dir, "--max-train-epochs", "1", "--output-dir", ""});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("(3 files, 10 samples: input [2] Float, target [] Float; shuffled each "
                       "epoch); 1 epoch of 10 samples: 2 steps"),
            std::string::npos)
      << r.out;

  // The fingerprint covers every file: rewriting one shard is a changed dataset.
  c.dataset_path = dir;
  const std::string before = data_fingerprint(c);
  EXPECT_EQ(data_fingerprint(c), before);
  save_safetensors(numbered_range(3, 7), dir + "/part-1.safetensors");
  EXPECT_EQ(data_fingerprint(c), before);  // the same bytes again
  Named other = numbered_range(3, 7);
  other[1].second[0] = 42;
  save_safetensors(other, dir + "/part-1.safetensors");
  EXPECT_NE(data_fingerprint(c), before);
}

// --save-every-n-epochs: a checkpoint after each step in which the samples drawn pass a multiple
// of N epochs (of the training part), whatever the batch and accumulation.
TEST(TrainerTensorData, CheckpointsFollowTheEpochs) {
  TrainConfig c = mlp_config("x", 4);
  c.output_dir = "out", c.epoch_samples = 10, c.save_every_n_epochs = 1;
  auto due = [&](int64_t steps) {
    std::vector<int64_t> out;
    for (int64_t s = 1; s <= steps; ++s)
      if (checkpoint_due(c, s, false)) out.push_back(s);
    return out;
  };
  EXPECT_EQ(due(13), (std::vector<int64_t>{3, 5, 8, 10, 13}));  // 12, 20, 32, 40, 52 samples
  c.save_every_n_epochs = 2;
  EXPECT_EQ(due(13), (std::vector<int64_t>{5, 10}));
  c.train_batch_size = 2, c.gradient_accumulation_steps = 2;  // 4 samples a step all the same
  EXPECT_EQ(due(13), (std::vector<int64_t>{5, 10}));
  c.train_batch_size = 25, c.gradient_accumulation_steps = 1, c.save_every_n_epochs = 1;
  EXPECT_EQ(due(3), (std::vector<int64_t>{1, 2, 3}));  // several epochs in one step: one file

  // Through the trainer: 10 samples, 2 held out, batches of 4: an epoch every 2 steps.
  TempDir tmp;
  save_safetensors(numbered(), tmp.file("d.safetensors"));
  const std::vector<std::string> args =
      two_step_epochs_run(tmp.file("d.safetensors"), "--save-every-n-epochs");
  Result r = run_trainer(join(args, {"--output-dir", tmp.file("out")}));
  ASSERT_EQ(r.code, 0) << r.err;
  std::vector<std::string> names;
  for (const auto& p : list_checkpoints(tmp.file("out"))) names.push_back(p.filename().string());
  EXPECT_EQ(names, (std::vector<std::string>{checkpoint_name(2), checkpoint_name(4),
                                             checkpoint_name(6), checkpoint_name(7)}));
  r = run_trainer(join(args, {"--output-dir", ""}));
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err,
            "trainer: error: --save-every-n-epochs: checkpoints live in --output-dir, which is "
            "empty; give one, or --save-every-n-epochs 0\n");
  r = run_trainer(
      {"--optimizer", "sgd", "--save-every-n-epochs", "1", "--output-dir", tmp.file("synthetic")});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err,
            "trainer: error: --save-every-n-epochs: counts passes over a --dataset tensors:PATH "
            "file's samples, and synthetic data have no epochs; give --save-every-n-steps\n");
}

// --eval-batches 0: one pass over the evaluation's samples in the file's order, the last batch
// holding the rest; the denoiser's noise of a batch depends on the seed and the batch alone.
TEST(TrainerTensorData, OnePassGivesEverySampleOnceInTheFilesOrder) {
  TempDir tmp;
  save_safetensors(numbered(), tmp.file("d.safetensors"));
  TrainConfig c = mlp_config(tmp.file("d.safetensors"), 2);
  c.eval_holdout = 0.5;
  EvalData eval(c);
  ASSERT_EQ(eval.pass_batches(), 3);  // samples 5 to 9 in batches of 2
  std::vector<int64_t> seen;
  for (int64_t i = 0; i < eval.pass_batches(); ++i) {
    const Batch b = eval.pass_batch(i);
    EXPECT_EQ(b.input.size(0), i < 2 ? 2 : 1) << i;
    EXPECT_EQ(b.target.sizes(), (at::IntArrayRef{b.input.size(0), 1}));
    for (int64_t r = 0; r < b.input.size(0); ++r)
      seen.push_back(static_cast<int64_t>(b.target[r][0].item<float>()));
  }
  EXPECT_EQ(seen, range(5, 10));
  EXPECT_EQ(make_data(mlp_config(tmp.file("d.safetensors"), 4))->pass_batches(), 3);

  c = mlp_config("", 2);
  c.model = "denoiser", c.image_size = 4;
  save_safetensors({{"images", at::zeros({5, 3, 4, 4}, at::kByte)}}, tmp.file("i.safetensors"));
  c.dataset_path = tmp.file("i.safetensors");
  std::unique_ptr<DataSource> data = make_data(c);
  const Batch last = data->pass_batch(2);
  EXPECT_EQ(last.noise.sizes(), (at::IntArrayRef{1, 3, 4, 4}));
  EXPECT_EQ(last.timesteps.sizes(), (at::IntArrayRef{1}));
  const Batch first = data->pass_batch(0);
  EXPECT_FALSE(at::equal(first.noise.narrow(0, 0, 1), last.noise));  // a batch's own noise
  EXPECT_TRUE(at::equal(data->pass_batch(2).noise, last.noise));     // whatever came before
  data->next();  // the training stream's draws do not touch it either
  EXPECT_TRUE(at::equal(data->pass_batch(2).noise, last.noise));
  data->restart(99);
  EXPECT_FALSE(at::equal(data->pass_batch(2).noise, last.noise));  // another seed, other noise
  EXPECT_EQ(make_data(mlp_config(tmp.file("d.safetensors")))->pass_batch(0).input.size(0), 4);
  c.dataset = "synthetic";
  EXPECT_EQ(make_data(c)->pass_batches(), 0);  // endless
}

// What each built-in model reads: the transformer's token ids split into input and next tokens,
// the denoiser's images with noise and timesteps drawn.
TEST(TrainerTensorData, TheBuiltInModelsReadTheirTensors) {
  TempDir tmp;
  TrainConfig c = mlp_config("");
  c.model = "transformer", c.seq_len = 4, c.vocab_size = 50;
  save_safetensors({{"ids", at::arange(30, at::kInt).reshape({6, 5})}}, tmp.file("t.safetensors"));
  c.dataset_path = tmp.file("t.safetensors");
  Batch b = make_data(c)->next();
  ASSERT_EQ(b.input.sizes(), (at::IntArrayRef{4, 4}));
  EXPECT_EQ(b.input.scalar_type(), at::kLong);
  EXPECT_TRUE(at::equal(b.target, b.input + 1));  // each row counts up
  EXPECT_TRUE(at::equal(b.input.select(1, 0).remainder(5), at::zeros({4}, at::kLong)));

  c.model = "denoiser", c.image_size = 4;
  save_safetensors({{"images", at::rand({6, 3, 4, 4}, at::kDouble) * 2 - 1}},
                   tmp.file("i.safetensors"));
  c.dataset_path = tmp.file("i.safetensors");
  b = make_data(c)->next();
  EXPECT_EQ(b.input.sizes(), (at::IntArrayRef{4, 3, 4, 4}));
  EXPECT_EQ(b.noise.sizes(), b.input.sizes());
  EXPECT_EQ(b.timesteps.sizes(), (at::IntArrayRef{4}));
  EXPECT_TRUE(b.input.abs().le(1).all().item<bool>());
  // 8-bit pixels: 0 is -1, 255 is 1.
  save_safetensors({{"images", at::cat({at::zeros({1, 3, 4, 4}, at::kByte),
                                        at::full({1, 3, 4, 4}, 255, at::kByte)})}},
                   tmp.file("pixels.safetensors"));
  c.dataset_path = tmp.file("pixels.safetensors"), c.train_batch_size = 2;
  b = make_data(c)->next();
  EXPECT_EQ(b.input.scalar_type(), at::kFloat);
  EXPECT_EQ(std::set<float>(b.input.data_ptr<float>(), b.input.data_ptr<float>() + 96),
            (std::set<float>{-1.0f, 1.0f}));
  save_safetensors({{"images", at::zeros({2, 3, 8, 8}, at::kLong)}}, tmp.file("long.safetensors"));
  c.dataset_path = tmp.file("long.safetensors");
  EXPECT_EQ(error_of([&] { make_data(c); }),
            "--dataset tensors:" + c.dataset_path +
                ": 'images' is [2, 3, 8, 8] Long; the denoiser reads one tensor of images "
                "[samples, 3, 4, 4] (--image-size 4): floating-point in [-1, 1], or uint8 pixels");
}

// A checkpoint written mid-epoch resumes the data where it stood: the resumed run's losses are
// the uninterrupted run's, bit for bit (without the data_samples counter the resumed run would
// start the first epoch again).
TEST(TrainerTensorData, AResumedRunContinuesMidEpoch) {
  TempDir tmp;
  at::manual_seed(3);
  const at::Tensor start = at::randint(32, {37, 1}, at::kLong);
  save_safetensors({{"tokens", (start + at::arange(9, at::kLong)).remainder(32)}},
                   tmp.file("tokens.safetensors"));
  auto run = [&](const std::string& out, const std::vector<std::string>& extra) {
    return run_trainer(join({"--model",
                             "transformer",
                             "--seq-len",
                             "8",
                             "--vocab-size",
                             "32",
                             "--model-width",
                             "16",
                             "--model-depth",
                             "1",
                             "--dataset",
                             "tensors:" + tmp.file("tokens.safetensors"),
                             "--train-batch-size",
                             "4",
                             "--optimizer",
                             "adamw",
                             "--max-train-steps",
                             "12",
                             "--log-every",
                             "0",
                             "--threads",
                             "1",
                             "--output-dir",
                             tmp.file(out)},
                            extra));
  };
  Result whole = run("whole", {"--save-every-n-steps", "5"});
  ASSERT_EQ(whole.code, 0) << whole.err;
  const Checkpoint ckpt = load_checkpoint(tmp.file("whole/" + checkpoint_name(5)));
  EXPECT_EQ(ckpt.counters.at("data_samples"), 20);
  Result resumed = run("resumed", {"--resume", tmp.file("whole/" + checkpoint_name(5))});
  ASSERT_EQ(resumed.code, 0) << resumed.err;
  const std::vector<double> a = losses(tmp.file("whole/metrics.jsonl")),
                            b = losses(tmp.file("resumed/metrics.jsonl"));
  ASSERT_EQ(a.size(), 12u);
  ASSERT_GE(b.size(), 7u);
  EXPECT_EQ(std::vector<double>(a.end() - 7, a.end()), std::vector<double>(b.end() - 7, b.end()));
}

// --max-train-epochs: the run's length in passes over the training samples (10 here, 8 with a
// fifth held out), in steps of batch x accumulation samples, the last one rounded up; refused
// without epochs to count or with --max-train-steps set too.
TEST(TrainerTensorData, EpochsSetTheNumberOfSteps) {
  TempDir tmp;
  save_safetensors(numbered(), tmp.file("d.safetensors"));
  auto steps = [&](const std::vector<std::string>& extra) {
    const Result r = run_trainer(join({"--model-width", "2", "--optimizer", "sgd", "--dataset",
                                       "tensors:" + tmp.file("d.safetensors"), "--log-every", "0",
                                       "--threads", "1", "--output-dir", tmp.file("out")},
                                      extra));
    EXPECT_EQ(r.code, 0) << r.err;
    std::filesystem::remove_all(tmp.file("out"));
    std::smatch m;
    const std::regex line("[0-9]+ epochs? of [0-9]+ samples: [0-9]+ steps");
    return std::regex_search(r.out, m, line) ? m.str() : "(no epochs in: " + r.out + ")";
  };
  EXPECT_EQ(steps({"--max-train-epochs", "3", "--train-batch-size", "4"}),
            "3 epochs of 10 samples: 8 steps");
  EXPECT_EQ(steps({"--max-train-epochs", "3", "--train-batch-size", "2",
                   "--gradient-accumulation-steps", "2"}),
            "3 epochs of 10 samples: 8 steps");
  EXPECT_EQ(steps({"--max-train-epochs", "3", "--train-batch-size", "4", "--eval-holdout", "0.2"}),
            "3 epochs of 8 samples: 6 steps");
  EXPECT_EQ(steps({"--max-train-epochs", "1", "--train-batch-size", "5"}),
            "1 epoch of 10 samples: 2 steps");
  const Result run = run_trainer({"--model-width", "2", "--optimizer", "sgd", "--dataset",
                                  "tensors:" + tmp.file("d.safetensors"), "--max-train-epochs", "2",
                                  "--train-batch-size", "3", "--log-every", "0", "--threads", "1",
                                  "--output-dir", tmp.file("run")});
  ASSERT_EQ(run.code, 0) << run.err;
  EXPECT_EQ(losses(tmp.file("run/metrics.jsonl")).size(), 7u);  // 20 samples in batches of 3

  auto refusal = [&](const std::vector<std::string>& args) {
    const Result r =
        run_trainer(join({"--optimizer", "sgd", "--output-dir", tmp.file("no")}, args));
    EXPECT_EQ(r.code, 2);
    return r.err;
  };
  EXPECT_EQ(refusal({"--max-train-epochs", "2"}),
            "trainer: error: --max-train-epochs: counts passes over a --dataset tensors:PATH "
            "file's samples, and synthetic data have no epochs; give --max-train-steps\n");
  EXPECT_EQ(refusal({"--dataset", "tensors:" + tmp.file("d.safetensors"), "--max-train-epochs", "2",
                     "--max-train-steps", "5"}),
            "trainer: error: --max-train-epochs and --max-train-steps both set the run's length: "
            "give one (--max-train-epochs 0 switches epochs off)\n");
  EXPECT_FALSE(std::filesystem::exists(tmp.file("no")));
}

// A script model's forward takes the file's tensors by name, whatever the order of its arguments;
// one tensor feeds a one-argument forward whatever its name; a torch.save'd dict is the same data
// as a safetensors file. The model learns the weights the data were made with.
TEST(TrainerTensorData, AScriptModelTakesTheTensorsAsForwardArguments) {
  TempDir tmp;
  auto script = [&](const std::string& name, const std::string& source) {
    torch::jit::Module m("Fit");
    m.register_parameter("w", torch::zeros({3, 1}, torch::kFloat64), false);
    m.define(source);
    m.save(tmp.file(name));
    return tmp.file(name);
  };
  const std::string named = script("named.pt", R"(
def forward(self, y, x):
    return ((x.matmul(self.w).squeeze(1) - y) ** 2).mean()
)");
  const std::string single = script("single.pt", R"(
def forward(self, batch):
    return ((batch[:, 0:3].matmul(self.w).squeeze(1) - batch[:, 3]) ** 2).mean()
)");
  at::manual_seed(1);
  const at::Tensor x = at::randn({64, 3}, at::kDouble), true_w = at::tensor({1.0, -2.0, 0.5});
  const at::Tensor y = x.matmul(true_w);
  save_safetensors({{"x", x}, {"y", y}}, tmp.file("xy.safetensors"));
  write_weights({{"x", x}, {"y", y}}, tmp.file("xy.pt"));
  save_safetensors({{"rows", at::cat({x, y.unsqueeze(1)}, 1)}}, tmp.file("rows.safetensors"));
  auto run = [&](const std::string& model, const std::string& data, const std::string& out) {
    return run_trainer({"--model-script",
                        model,
                        "--dataset",
                        "tensors:" + data,
                        "--dtype",
                        "float64",
                        "--optimizer",
                        "sgd",
                        "--learning-rate",
                        "0.1",
                        "--train-batch-size",
                        "8",
                        "--max-train-steps",
                        "150",
                        "--log-every",
                        "0",
                        "--threads",
                        "1",
                        "--output-dir",
                        tmp.file(out),
                        "--save-model",
                        tmp.file(out + ".safetensors")});
  };
  for (const auto& [model, data, out] :
       std::vector<std::tuple<std::string, std::string, std::string>>{
           {named, tmp.file("xy.safetensors"), "named"},
           {named, tmp.file("xy.pt"), "pickled"},
           {single, tmp.file("rows.safetensors"), "single"}}) {
    Result r = run(model, data, out);
    ASSERT_EQ(r.code, 0) << out << ": " << r.err;
    const at::Tensor w = load_safetensors(tmp.file(out + ".safetensors")).at("w").flatten();
    EXPECT_TRUE(at::allclose(w, true_w, 0, 1e-3)) << out << ": " << w;
  }
  EXPECT_EQ(losses(tmp.file("named/metrics.jsonl")), losses(tmp.file("pickled/metrics.jsonl")));
}

// --check-data makes the data as a run would, every value checked, prints the data line and
// trains and writes nothing; a bad value is the run's own error line, exit 2.
TEST(TrainerTensorData, CheckDataChecksEveryValueAndTrainsNothing) {
  TempDir tmp;
  save_safetensors(numbered(), tmp.file("d.safetensors"));
  const std::vector<std::string> args = {
      "--optimizer",        "sgd",
      "--model-width",      "2",
      "--dataset",          "tensors:" + tmp.file("d.safetensors"),
      "--eval-holdout",     "0.2",
      "--eval-every",       "5",
      "--eval-batches",     "0",
      "--max-train-epochs", "3",
      "--output-dir",       tmp.file("out"),
      "--check-data"};
  Result r = run_trainer(args);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, "data: tensors " + tmp.file("d.safetensors") +
                       " (the first 8 of 10 samples, 2 held out: input [2] Float, target [] "
                       "Float; shuffled each epoch); 3 epochs of 8 samples: 3 steps; eval: every "
                       "sample (1 batch) every 5 steps from tensors " +
                       tmp.file("d.safetensors") +
                       " (the last 2 of 10 samples, held out for evaluation: input [2] Float, "
                       "target [] Float; shuffled each epoch)\n");
  EXPECT_FALSE(std::filesystem::exists(tmp.file("out")));

  Named bad = numbered();
  bad[0].second[9][1] = NAN;  // a held-out sample: the training stream checks both parts
  save_safetensors(bad, tmp.file("d.safetensors"));
  r = run_trainer(args);
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "trainer: error: --dataset tensors:" + tmp.file("d.safetensors") +
                       ": 'input' holds values that are not finite (NaN or Inf): a NaN sample "
                       "makes the loss NaN; clean or drop those samples\n");
  EXPECT_FALSE(std::filesystem::exists(tmp.file("out")));
}

// --check-data reads the zip archives (torch.save'd, .npz) whole against their CRC-32s: a value
// changed on disk that is still a valid number, which no other check sees, is named with its entry
// (in a folder, with its file), exit 2.
TEST(TrainerTensorData, CheckDataReadsArchivesAgainstTheirCrcs) {
  TempDir tmp;
  std::filesystem::create_directories(tmp.file("shards"));
  const std::string file = tmp.file("shards/part-1.pt");
  save_model_weights(numbered(), tmp.file("shards/part-0.pt"));
  save_model_weights(numbered(), file);
  auto check = [&](const std::string& path) {
    return run_trainer({"--optimizer", "sgd", "--model-width", "2", "--dataset", "tensors:" + path,
                        "--check-data"});
  };
  Result r = check(file);
  ASSERT_EQ(r.code, 0) << r.err;
  if (!zlib_available()) {
    EXPECT_NE(r.out.find("; the CRC-32s of 1 archive were not checked (this fusebox was built "
                         "without zlib)\n"),
              std::string::npos)
        << r.out;
    return;
  }
  const std::regex counted(".*; CRC-32s of ([0-9]+) archive entries checked\n");
  std::smatch m;
  ASSERT_TRUE(std::regex_match(r.out, m, counted)) << r.out;
  const int entries = std::stoi(m[1]);
  EXPECT_GE(entries, 3);  // the pickle and a record per tensor, at least
  r = check(tmp.file("shards"));
  ASSERT_TRUE(std::regex_match(r.out, m, counted)) << r.out;
  EXPECT_EQ(std::stoi(m[1]), 2 * entries);

  // 7.0f (input[3][1]) becomes 8.0f: finite, so only the CRC-32 tells.
  std::string bytes = ::fusebox::testing::file_bytes(file);
  const float seven = 7, eight = 8;
  const size_t at = bytes.find(std::string(reinterpret_cast<const char*>(&seven), 4));
  ASSERT_NE(at, std::string::npos);
  bytes.replace(at, 4, std::string(reinterpret_cast<const char*>(&eight), 4));
  std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes;
  const std::regex damaged(
      "trainer: error: --dataset tensors:(.*): '[^']+' is damaged: its "
      "content does not match its CRC-32; copy or write the file again\n");
  r = check(file);
  EXPECT_EQ(r.code, 2);
  ASSERT_TRUE(std::regex_match(r.err, m, damaged)) << r.err;
  EXPECT_EQ(m[1], file);
  r = check(tmp.file("shards"));
  EXPECT_EQ(r.code, 2);
  ASSERT_TRUE(std::regex_match(r.err, m, damaged)) << r.err;
  EXPECT_EQ(m[1], tmp.file("shards") + ": " + file);  // the folder, then the file in it
  // Training views the records and does not read them whole: it takes the 8.
  EXPECT_EQ(run_trainer({"--optimizer", "sgd", "--model-width", "2", "--dataset", "tensors:" + file,
                         "--max-train-steps", "1"})
                .code,
            0);
}

// Files that do not fit the model, or are not data, are refused in one line naming the option
// and the file, saying what the model reads.
TEST(TrainerTensorData, UnfitFilesAreRefusedWithWhatTheModelReads) {
  TempDir tmp;
  auto file = [&](const std::string& name, const Named& tensors) {
    save_safetensors(tensors, tmp.file(name));
    return tmp.file(name);
  };
  auto refusal = [](TrainConfig c, const std::vector<ForwardArgument>& forward = {}) {
    return error_of([&] { make_data(c, forward); });
  };
  const at::Tensor four = at::zeros({4, 2});
  std::string p = file("uneven.safetensors", {{"input", four}, {"target", at::zeros({3})}});
  EXPECT_EQ(refusal(mlp_config(p)),
            "--dataset tensors:" + p +
                ": 'target' has 3 samples (its first dimension), 'input' has 4: every tensor holds "
                "one row per sample");
  at::Tensor nan = four.clone();
  nan[2][1] = NAN;
  p = file("nan.safetensors", {{"input", nan}, {"target", at::zeros({4})}});
  EXPECT_EQ(refusal(mlp_config(p)),
            "--dataset tensors:" + p +
                ": 'input' holds values that are not finite (NaN or Inf): a NaN sample makes the "
                "loss NaN; clean or drop those samples");
  p = file("scalar.safetensors", {{"input", four}, {"target", at::zeros({})}});
  EXPECT_EQ(refusal(mlp_config(p)), "--dataset tensors:" + p +
                                        ": 'target' is a scalar: every tensor's first dimension "
                                        "counts the samples");
  p = file("wide.safetensors", {{"input", at::zeros({4, 3})}, {"target", at::zeros({4})}});
  EXPECT_EQ(refusal(mlp_config(p)),
            "--dataset tensors:" + p +
                ": 'input' is [4, 3] Float; the mlp reads 'input' [samples, 2] (--model-width) and "
                "'target' [samples, 1], both floating-point (give --model-width 3)");

  TrainConfig c = mlp_config(file("tokens.safetensors", {{"t", at::full({4, 9}, 7, at::kLong)}}));
  c.model = "transformer", c.seq_len = 16, c.vocab_size = 8;
  EXPECT_EQ(refusal(c), "--dataset tensors:" + c.dataset_path +
                            ": 't' has shape [4, 9]; the transformer reads one tensor of token ids "
                            "[samples, 17] (--seq-len + 1: input and next tokens) (give --seq-len "
                            "8)");
  c.seq_len = 8, c.vocab_size = 7;
  EXPECT_EQ(refusal(c), "--dataset tensors:" + c.dataset_path +
                            ": 't' holds token id 7, outside --vocab-size 7 (ids 0 to 6)");

  c = mlp_config(file("xz.safetensors", {{"x", four}, {"z", four}}));
  c.model_script = "m.pt";
  EXPECT_EQ(refusal(c, {{"x", false}, {"y", false}}),
            "--dataset tensors:" + c.dataset_path +
                " holds 'z', which the model script's forward(x, y) has no argument of: name the "
                "file's tensors after forward's arguments");
  c.dataset_path = file("x.safetensors", {{"x", four}});
  EXPECT_EQ(refusal(c, {{"x", false}, {"y", false}}),
            "--dataset tensors:" + c.dataset_path +
                " has no 'y' for the model script's forward(x, y): name the file's tensors after "
                "forward's arguments");
  EXPECT_EQ(refusal(c, {{"mask", false}, {"x", true}}),
            "--dataset tensors:" + c.dataset_path +
                " has no 'mask' for the model script's forward(mask, x=...): name the file's "
                "tensors after forward's arguments");

  // Data that give forward one tensor, for a forward that needs two: refused before training.
  TrainConfig synthetic = mlp_config("");
  synthetic.model_script = "m.pt", synthetic.dataset = "synthetic";
  EXPECT_EQ(refusal(synthetic, {{"y", false}, {"x", false}, {"weight", true}}),
            "--dataset synthetic gives the model script's forward one tensor, and it needs 2 (y, "
            "x): give --dataset tensors:PATH with tensors named after them");
  EXPECT_EQ(refusal(synthetic, {{"x", false}, {"weight", true}}), "(no error)");
  EXPECT_EQ(refusal(c, {}), "--dataset tensors:" + c.dataset_path +
                                " gives the model script's forward data, and it takes no argument "
                                "(it makes its own data): give --dataset none");

  c.dataset_path = tmp.write("notes.txt", "not tensors at all");
  EXPECT_EQ(refusal(c, {{"x", false}}),
            "--dataset tensors:" + c.dataset_path +
                " is neither a safetensors, a NumPy nor a torch.save'd file: give a safetensors "
                "file, a .npy or .npz file (np.save, np.savez), a torch.save'd {name: tensor} "
                "dict of samples, or a headerless .bin file of token ids of --token-dtype");

  // The trainer: exit 2, one line, nothing written.
  const Result r =
      run_trainer({"--optimizer", "sgd", "--dataset", "tensors:" + tmp.file("uneven.safetensors"),
                   "--output-dir", tmp.file("out")});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err.rfind("trainer: error: --dataset tensors:", 0), 0u) << r.err;
  EXPECT_EQ(testing::count_lines(r.err), 1) << r.err;
  EXPECT_FALSE(std::filesystem::exists(tmp.file("out")));
}

}  // namespace
}  // namespace fusebox::trainer
