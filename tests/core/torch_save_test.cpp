// torch.save'd files read by mapping: the tensors view the file, nothing is copied, a write in
// place stays in the process, and a pickle that claims more bytes than its record holds is
// refused.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <fstream>
#include <iterator>

#include "../error_of.h"
#include "../peak_memory.h"
#include "../scratch_dir.h"
#include "fusebox/core/checkpoint.h"
#include "fusebox/core/memory_tracker.h"

using namespace fusebox;
using fusebox::testing::error_of;
using fusebox::testing::file_bytes;
using fusebox::testing::is_mapped;
using fusebox::testing::peak_growth_kib;
using fusebox::testing::ScratchDir;
namespace fs = std::filesystem;

TEST(TorchSave, AFileIsMappedAndItsTensorsViewItWithoutCopies) {
  const ScratchDir scratch("torch-save-map");
  const fs::path file = scratch.path() / "weights.pt";
  const at::Tensor big = at::randn({1024, 1024});  // 4 MiB
  const at::Tensor ids = at::arange(10, at::kLong), half = at::randn({3, 5}).to(at::kBFloat16);
  save_model_weights({{"big", big}, {"ids", ids}, {"half", half}, {"none", at::empty({0, 4})}},
                     file);

  memory::install_cpu_tracking();
  const int64_t base = memory::current_bytes();
  memory::reset_peak();
  bool mapped = false;
  std::map<std::string, at::Tensor> back = load_model_weights(file, &mapped);
  EXPECT_TRUE(mapped);
  // Read into memory, the 4 MiB would be allocated at least once as tensors.
  EXPECT_LT(memory::peak_bytes() - base, 256 * 1024);
  ASSERT_EQ(back.size(), 4u);
  EXPECT_TRUE(at::equal(back.at("big"), big));
  EXPECT_TRUE(at::equal(back.at("ids"), ids));
  EXPECT_TRUE(at::equal(back.at("half"), half));
  EXPECT_EQ(back.at("none").sizes(), (std::vector<int64_t>{0, 4}));
  EXPECT_TRUE(is_mapped(file));

  // Copy-on-write: a write in place changes this process's tensor, never the file.
  back.at("big").fill_(7.0);
  EXPECT_TRUE(at::equal(load_model_weights(file).at("big"), big));
  back.clear();
  EXPECT_FALSE(is_mapped(file));  // the last tensor gone, the file is unmapped
}

TEST(TorchSave, AStorageOrTensorReachingPastItsRecordIsRefused) {
  const ScratchDir scratch("torch-save-short");
  const fs::path file = scratch.path() / "w.pt";
  save_model_weights({{"w", at::tensor({1.0f, 2.0f, 3.0f, 4.0f})}}, file);
  // The pickle's storage length and size, 4 (BININT1 4), made 8: the zip stays valid, the
  // record holds 16 bytes and the pickle asks for 32.
  std::string bytes = file_bytes(file);
  const size_t begin = bytes.find("data.pkl"), end = bytes.find("PK", begin);
  ASSERT_NE(begin, std::string::npos);
  int patched = 0;
  for (size_t at = bytes.find("K\x04", begin); at < end; at = bytes.find("K\x04", at + 2))
    bytes[at + 1] = '\x08', ++patched;
  ASSERT_EQ(patched, 2);  // the storage's length and the tensor's size
  std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes;
  std::string msg = error_of([&] { load_model_weights(file); });
  EXPECT_NE(msg.find("model weights " + file.string() + " cannot be decoded"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("'w' needs 32 bytes of storage, and its record holds 16"), std::string::npos)
      << msg;

  // The tensor's size alone made 8: its storage fits its record, the tensor reaches past both
  // (LibTorch's unpickler sets sizes and strides unchecked).
  bytes[bytes.find("K\x08", begin) + 1] = '\x04';  // the first: the storage's length
  std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes;
  msg = error_of([&] { load_model_weights(file); });
  EXPECT_NE(msg.find("'w' (sizes [8], strides [1], offset 0) reaches past its storage of 16 bytes"),
            std::string::npos)
      << msg;
}

TEST(TorchSave, AFileThatIsNoArchiveGetsTheReadersMessage) {
  const ScratchDir scratch("torch-save-bad");
  const fs::path file = scratch.path() / "w.pt";
  std::ofstream(file, std::ios::binary) << "PK\x03\x04 but nothing more";
  bool mapped = true;
  const std::string msg = error_of([&] { load_model_weights(file, &mapped); });
  EXPECT_NE(msg.find("model weights " + file.string() + " cannot be decoded"), std::string::npos)
      << msg;
  EXPECT_FALSE(mapped);
}

// Saving streams the archive into the file: the peak resident memory does not grow by the
// weights' size (pickle_save would build the whole archive in memory, and a copy of it).
TEST(TorchSave, SavingHoldsNoCopyOfTheWeights) {
  const ScratchDir scratch("torch-save-stream");
  const fs::path file = scratch.path() / "w.pt";
  const at::Tensor w = at::rand({32, 1024, 1024});  // 128 MiB
  const std::optional<long long> grew = peak_growth_kib([&] {
    save_model_weights({{"w", w}, {"b", at::arange(3.0)}}, file);
  });
  EXPECT_LT(grew.value_or(0), 16 * 1024) << "KiB";
  const auto back = load_model_weights(file);
  EXPECT_TRUE(at::equal(back.at("w"), w));
  EXPECT_TRUE(at::equal(back.at("b"), at::arange(3.0)));
}

// A tensor that is not a contiguous CPU tensor (one on a GPU, or a transposed view, as here) is
// brought to the CPU and made contiguous alone, as its record is written: saving four 32 MiB
// views holds one such copy at a time, not all four (which would raise the peak by 128 MiB). The
// pickle says "cpu" and the values read back (Python's torch.load reads the same file:
// tests/python/torch_interop.py).
TEST(TorchSave, ATensorToCopyIsCopiedAloneAsItIsWritten) {
  const ScratchDir scratch("torch-save-views");
  const fs::path file = scratch.path() / "w.pt";
  std::vector<std::pair<std::string, at::Tensor>> weights;
  for (int i = 0; i < 4; ++i)
    weights.emplace_back("t" + std::to_string(i), at::rand({2048, 4096}).t());  // 32 MiB each
  weights.emplace_back("empty", at::empty({0, 3}).t());
  weights.emplace_back("bf16", at::rand({3, 5}).to(at::kBFloat16).t());
  const std::optional<long long> grew = peak_growth_kib([&] { save_model_weights(weights, file); });
  EXPECT_LT(grew.value_or(0), 48 * 1024) << "KiB";
  const auto back = load_model_weights(file);
  ASSERT_EQ(back.size(), weights.size());
  for (const auto& [name, t] : weights) {
    EXPECT_TRUE(at::equal(back.at(name), t)) << name;
    EXPECT_TRUE(back.at(name).is_contiguous()) << name;
    EXPECT_TRUE(back.at(name).device().is_cpu()) << name;
  }
}
