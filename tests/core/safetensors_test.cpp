// safetensors: exact round trips of every dtype, a file laid out by hand as the format describes
// it, and one Error (never a crash) for each way a file can be wrong.
#include "fusebox/core/safetensors.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>

#include "../error_of.h"
#include "../peak_memory.h"
#include "../scratch_dir.h"
#include "fusebox/core/checkpoint.h"
#include "fusebox/error.h"

using namespace fusebox;
using fusebox::testing::error_of;
using fusebox::testing::file_bytes;
using fusebox::testing::ScratchDir;

namespace {

uint64_t le64(const std::string& b) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(b[i]);
  return v;
}

// A file of `header` (padded with spaces to 8 bytes, as writers do) and `data`.
std::string file_of(std::string header, const std::string& data) {
  header.append((8 - header.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((header.size() >> (8 * i)) & 0xFF);
  return out + header + data;
}

std::string bytes_of(const at::Tensor& t) {
  return std::string(static_cast<const char*>(t.data_ptr()), t.numel() * t.element_size());
}

}  // namespace

// Every dtype the format names comes back bit for bit, with its shape (a scalar and an empty
// tensor too); a non-contiguous tensor is written as its values; each tensor starts aligned to its
// element size; metadata round-trips beside "format": "pt".
TEST(Safetensors, EveryDtypeRoundTripsExactly) {
  at::manual_seed(3);
  const std::vector<std::pair<std::string, at::Tensor>> tensors = {
      {"f64", at::randn({3, 2}, at::kDouble)},
      {"f32.t", at::randn({4, 3}).t()},  // not contiguous
      {"f16", at::randn({5}).to(at::kHalf)},
      {"bf16", at::randn({2, 2, 2}).to(at::kBFloat16)},
      {"i64", at::arange(-3, 4, at::kLong)},
      {"i32", at::tensor({-7, 1 << 30}, at::kInt)},
      {"i16", at::tensor({-300, 300}, at::kShort)},
      {"i8", at::tensor({-128, 127}, at::kChar)},
      {"u8", at::tensor({0, 255}, at::kByte)},
      {"bool", at::tensor({1, 0, 1}, at::kByte).to(at::kBool)},
      {"scalar", at::scalar_tensor(2.5)},
      {"empty", at::zeros({0, 4})},
      {"name \"with\" \\ and \n", at::ones({1})}};
  std::map<std::string, std::string> meta_in = {{"step", "12"}, {"note", "a \"quoted\" value"}};
  const std::string bytes = encode_safetensors(tensors, meta_in);
  const uint64_t n = le64(bytes);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_EQ(bytes[8], '{');
  std::map<std::string, std::string> meta;
  const auto back = parse_safetensors(bytes, "mem", &meta);
  ASSERT_EQ(back.size(), tensors.size());
  for (const auto& [name, t] : tensors) {
    const at::Tensor& b = back.at(name);
    EXPECT_EQ(b.scalar_type(), t.scalar_type()) << name;
    EXPECT_EQ(b.sizes(), t.sizes()) << name;
    EXPECT_EQ(bytes_of(b), bytes_of(t.contiguous())) << name;
    // Aligned: the tensor's bytes start at a multiple of its element size within the file.
    const std::string mine = bytes_of(t.contiguous());
    if (!mine.empty()) {
      const size_t at_offset = bytes.find(mine, 8 + n);
      ASSERT_NE(at_offset, std::string::npos) << name;
      EXPECT_EQ((at_offset - 8 - n) % t.element_size(), 0u) << name;
    }
  }
  EXPECT_EQ(meta.at("format"), "pt");
  EXPECT_EQ(meta.at("step"), "12");
  EXPECT_EQ(meta.at("note"), "a \"quoted\" value");

  ScratchDir dir("safetensors");
  const std::string path = dir.file("w.safetensors");
  save_safetensors(tensors, path, meta_in);
  std::ifstream in(path, std::ios::binary);
  const std::string on_disk((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(on_disk, bytes);
  const auto loaded = load_safetensors(path);
  for (const auto& [name, t] : tensors) EXPECT_TRUE(at::equal(loaded.at(name), back.at(name)));
}

// A file laid out by hand as the format's description gives it: metadata last, keys in any
// order, whitespace, a \u escape and a surrogate pair in names, tensors in any byte order.
TEST(Safetensors, ReadsAFileLaidOutByHand) {
  const float w[4] = {1.0f, -2.0f, 0.5f, 3.0f};
  std::string data(reinterpret_cast<const char*>(w), sizeof w);
  data += std::string("\x80\x3f\x00\x40\x40\x40", 6);  // BF16 1, 2, 3
  data += std::string("\x01\x00", 2);                  // BOOL
  const std::string header = R"({
    "b\u00e9\ud83d\ude00": {"shape": [3], "data_offsets": [16, 22], "dtype": "BF16"},
    "mask": {"dtype": "BOOL", "shape": [2], "data_offsets": [22, 24]},
    "w": {"data_offsets": [0, 16], "dtype": "F32", "shape": [2, 2]},
    "__metadata__": {"format": "pt"}
  })";
  const auto t = parse_safetensors(file_of(header, data), "hand");
  ASSERT_EQ(t.size(), 3u);
  EXPECT_TRUE(at::equal(t.at("w"), at::tensor({1.0f, -2.0f, 0.5f, 3.0f}).reshape({2, 2})));
  EXPECT_TRUE(at::equal(t.at("b\xC3\xA9\xF0\x9F\x98\x80"),
                        at::tensor({1.0f, 2.0f, 3.0f}).to(at::kBFloat16)));
  EXPECT_TRUE(at::equal(t.at("mask"), at::tensor({1, 0}, at::kByte).to(at::kBool)));
}

// Each way a file can be wrong is one Error naming it and the fault.
// U16 and U32 (numpy's uint16 token ids, say), which LibTorch has no type for, come back widened
// into int32 and int64 with every value unchanged, the top of their range included, whether the
// file is parsed, read or mapped.
TEST(Safetensors, UnsignedTensorsAreWidenedWithTheirValues) {
  std::string data;
  const uint16_t u16[] = {0, 1, 32767, 32768, 65535, 50256};
  const uint32_t u32[] = {0, 2147483647u, 2147483648u, 4294967295u};
  data.append(reinterpret_cast<const char*>(u16), sizeof u16);
  data.append(4, '\0');  // U32 starts aligned
  data.append(reinterpret_cast<const char*>(u32), sizeof u32);
  const std::string file = file_of(R"({"ids":{"dtype":"U16","shape":[2,3],"data_offsets":[0,12]},)"
                                   R"("big":{"dtype":"U32","shape":[4],"data_offsets":[16,32]}})",
                                   data);
  ScratchDir dir("safetensors");
  const std::string path = (dir.path() / "u.safetensors").string();
  std::ofstream(path, std::ios::binary) << file;
  for (const auto& read : std::vector<std::function<std::map<std::string, at::Tensor>()>>{
           [&] { return parse_safetensors(file, "mem"); }, [&] { return load_safetensors(path); },
           [&] { return map_safetensors(path); }}) {
    const auto t = read();
    ASSERT_EQ(t.at("ids").scalar_type(), at::kInt);
    EXPECT_EQ(t.at("ids").sizes(), (at::IntArrayRef{2, 3}));
    EXPECT_TRUE(at::equal(t.at("ids"),
                          at::tensor({0, 1, 32767, 32768, 65535, 50256}, at::kInt).view({2, 3})));
    ASSERT_EQ(t.at("big").scalar_type(), at::kLong);
    EXPECT_TRUE(at::equal(t.at("big"), at::tensor({int64_t{0}, int64_t{2147483647},
                                                   int64_t{2147483648}, int64_t{4294967295}},
                                                  at::kLong)));
  }
  // Written back, they are the signed types that hold them.
  const std::string again = encode_safetensors({{"ids", parse_safetensors(file, "m").at("ids")}});
  EXPECT_NE(again.find(R"("dtype":"I32")"), std::string::npos);
  // The widened types still need their own byte count: a U16 tensor of 4-byte elements is wrong.
  EXPECT_NE(error_of([&] {
              parse_safetensors(
                  file_of(R"({"ids":{"dtype":"U16","shape":[2],"data_offsets":[0,8]}})",
                          std::string(8, '\0')),
                  "mem");
            }).find("its data_offsets span 8 bytes, its dtype and shape need 4"),
            std::string::npos);
}

// 8-bit float weights (float8_e4m3fn, float8_e5m2, as published fp8 checkpoints hold them) read
// as bf16 with every value exact.
TEST(Safetensors, Float8TensorsAreWidenedIntoBf16Exactly) {
  std::string e4m3, e5m2;
  for (int b = 0; b < 256; ++b) e4m3 += static_cast<char>(b), e5m2 += static_cast<char>(b);
  const std::string file =
      file_of(R"({"a":{"dtype":"F8_E4M3","shape":[16,16],"data_offsets":[0,256]},)"
              R"("b":{"dtype":"F8_E5M2","shape":[256],"data_offsets":[256,512]}})",
              e4m3 + e5m2);
  ScratchDir dir("safetensors-f8");
  const std::string path = (dir.path() / "f8.safetensors").string();
  std::ofstream(path, std::ios::binary) << file;
  for (const auto& t : {parse_safetensors(file, "mem"), map_safetensors(path)}) {
    ASSERT_EQ(t.at("a").scalar_type(), at::kBFloat16);
    ASSERT_EQ(t.at("a").sizes(), (at::IntArrayRef{16, 16}));
    const at::Tensor a = t.at("a").flatten().to(at::kFloat), b = t.at("b").to(at::kFloat);
    auto v = [&](int code) { return a[code].item<float>(); };
    // E4M3 (bias 7, 3 mantissa bits, no infinities): the values that pin the format down.
    EXPECT_EQ(v(0x00), 0.0f);
    EXPECT_EQ(v(0x01), std::ldexp(1.0f, -9));  // the smallest subnormal
    EXPECT_EQ(v(0x07), 7 * std::ldexp(1.0f, -9));
    EXPECT_EQ(v(0x08), std::ldexp(1.0f, -6));  // the smallest normal
    EXPECT_EQ(v(0x38), 1.0f);
    EXPECT_EQ(v(0x39), 1.125f);
    EXPECT_EQ(v(0x7E), 448.0f);  // the largest
    EXPECT_TRUE(std::isnan(v(0x7F)) && std::isnan(v(0xFF)));
    for (int code = 1; code < 0x7F; ++code) {
      EXPECT_GT(v(code), v(code - 1)) << code;  // every code a value of its own, in order
      EXPECT_EQ(v(code | 0x80), -v(code)) << code;
    }
    // E5M2 is the top byte of an IEEE float16: every code against LibTorch's float16.
    std::vector<uint16_t> halves;
    for (int code = 0; code < 256; ++code) halves.push_back(static_cast<uint16_t>(code << 8));
    const at::Tensor half = at::from_blob(halves.data(), {256}, at::kShort).view(at::kHalf);
    const at::Tensor want = half.to(at::kFloat);
    EXPECT_TRUE(at::equal(at::isnan(b), at::isnan(want)));
    EXPECT_TRUE(at::equal(at::nan_to_num(b, 0.0, 1e9, -1e9), at::nan_to_num(want, 0.0, 1e9, -1e9)));
    EXPECT_EQ(b[0x7B].item<float>(), 57344.0f);
    EXPECT_TRUE(std::isinf(b[0x7C].item<float>()) && std::isnan(b[0x7D].item<float>()));
  }
  // Written back, they are BF16.
  EXPECT_NE(
      encode_safetensors({{"a", parse_safetensors(file, "m").at("a")}}).find(R"("dtype":"BF16")"),
      std::string::npos);
}

TEST(Safetensors, EveryBadFileIsOneErrorNamingTheFault) {
  const std::string f32x2(8, '\0');
  const std::string ok = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  ASSERT_EQ(error_of([&] { parse_safetensors(file_of(ok, f32x2), "f"); }), "(no error)");
  std::string huge(8, '\0');
  huge[7] = 0x01;
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"short", "shorter than its 8-byte header size"},
      {file_of(ok, f32x2).substr(0, 20), "is larger than the file (a truncated file?)"},
      {huge + "{}", "is larger than 100 MiB"},
      {file_of(ok, f32x2.substr(0, 4)), "are not inside the 4 bytes of data (a truncated file?)"},
      {file_of(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},})", f32x2),
       "not valid JSON (a name in quotes expected"},
      {file_of(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})", f32x2),
       "not valid JSON (it ends early"},
      {file_of(R"({"w":{"dtype":"F32","shape":true,"data_offsets":[0,8]}})", f32x2),
       "unexpected character"},
      {file_of(R"({"w":[[[[[[[[[[1]]]]]]]]]]})", f32x2), "nested too deep"},
      {file_of(R"({"w":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}})", f32x2),
       "the name 'dtype' given twice"},
      {file_of(R"({"w\q":{}})", f32x2), "an unknown escape"},
      {file_of(R"({"w\ud800":{}})", f32x2), "a high surrogate without its low one"},
      {file_of(R"({"w":{"dtype":"F8_E8M0","shape":[8],"data_offsets":[0,8]}})", f32x2),
       "tensor 'w': dtype 'F8_E8M0' is not one fusebox reads"},
      {file_of(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", f32x2),
       "its data_offsets span 8 bytes, its dtype and shape need 12"},
      {file_of(R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", f32x2),
       "a dimension is not a whole number"},
      {file_of(R"({"w":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", f32x2),
       "a dimension is not a whole number"},
      {file_of(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})",
               f32x2),
       "its shape holds more bytes than any file"},
      {file_of(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", f32x2),
       "are not inside"},
      {file_of(R"({"w":{"dtype":"F32","shape":[2]}})", f32x2), "needs a dtype (a string)"},
      {file_of(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
               R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
               f32x2),
       "the data of tensors 'a' and 'b' overlap"},
      {file_of(R"({"__metadata__":{"step":3}})", ""), "__metadata__ 'step' is not a string"},
      {file_of(R"({"m":{"dtype":"BOOL","shape":[2],"data_offsets":[0,2]}})", "\x01\x02"),
       "is BOOL and holds a byte other than 0 or 1"},
      {file_of("[]", ""), "its header is not a JSON object"}};
  ScratchDir dir("safetensors-bad");
  for (const auto& [file, expected] : cases) {
    const std::string& bytes = file;  // a lambda may not capture a structured binding in C++17
    const std::string e = error_of([&] { parse_safetensors(bytes, "bad.safetensors"); });
    EXPECT_EQ(e.rfind("bad.safetensors: not ", 0), 0u) << e;
    EXPECT_NE(e.find(expected), std::string::npos) << expected << "\n got: " << e;
    // The same file mapped into memory gets the same error.
    const std::string path = dir.file("bad.safetensors");
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
    EXPECT_EQ(error_of([&] { map_safetensors(path); }),
              error_of([&] { parse_safetensors(bytes, path); }));
  }

  // A file on disk cut short, and one that is not there.
  const std::string whole = encode_safetensors({{"w", at::randn({64})}});
  const std::string cut = dir.file("cut.safetensors");
  std::ofstream(cut, std::ios::binary) << whole.substr(0, whole.size() - 3);
  EXPECT_NE(error_of([&] { load_safetensors(cut); }).find("a truncated file?"), std::string::npos);
  EXPECT_NE(error_of([&] { map_safetensors(cut); }).find("a truncated file?"), std::string::npos);
  EXPECT_NE(error_of([&] {
              load_safetensors(dir.file("none.safetensors"));
            }).find("none.safetensors does not exist"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              map_safetensors(dir.file("none.safetensors"));
            }).find("none.safetensors does not exist"),
            std::string::npos);
  std::ofstream(dir.file("empty.safetensors"), std::ios::binary);
  EXPECT_NE(error_of([&] {
              map_safetensors(dir.file("empty.safetensors"));
            }).find("shorter than its 8-byte header size"),
            std::string::npos);

  // What the format cannot hold is refused when writing.
  EXPECT_NE(error_of([&] {
              encode_safetensors({{"c", at::zeros({2}, at::kComplexFloat)}});
            }).find("which the format has no name for"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              encode_safetensors({{"a", at::zeros({1})}, {"a", at::zeros({1})}});
            }).find("given twice"),
            std::string::npos);
}

// A mapped file gives the tensors a read gives, bit for bit: every dtype, a tensor whose bytes are
// not aligned to its element size (copied out) and an empty one. Writing to a mapped tensor
// changes this process's copy, not the file; a tensor outlives the map it came from.
TEST(Safetensors, AMappedFileGivesWhatAReadGives) {
  ScratchDir dir("safetensors-map");
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const at::ScalarType type : {at::kDouble, at::kFloat, at::kHalf, at::kBFloat16, at::kLong,
                                    at::kInt, at::kShort, at::kChar, at::kByte, at::kBool})
    tensors.emplace_back(c10::toString(type), (at::randn({3, 5}) * 50).to(type));
  tensors.emplace_back("empty", at::zeros({0, 4}));
  const std::string path = dir.file("w.safetensors");
  save_safetensors(tensors, path);
  const auto loaded = load_safetensors(path);
  auto mapped = map_safetensors(path);
  ASSERT_EQ(mapped.size(), loaded.size());
  for (const auto& [name, t] : loaded) {
    EXPECT_EQ(mapped.at(name).scalar_type(), t.scalar_type()) << name;
    EXPECT_EQ(bytes_of(mapped.at(name)), bytes_of(t)) << name;
  }

  // A 61-byte header: the data start at byte 69, so the F32 tensor at offset 0 is misaligned.
  const std::string header = R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,12]}}      )";
  ASSERT_EQ(header.size(), 61u);
  const float w[3] = {1.5f, -2.0f, 3.25f};
  std::string file(8, '\0');
  file[0] = static_cast<char>(header.size());
  file += header + std::string(reinterpret_cast<const char*>(w), sizeof w);
  std::ofstream(dir.file("odd.safetensors"), std::ios::binary) << file;
  EXPECT_TRUE(at::equal(map_safetensors(dir.file("odd.safetensors")).at("w"),
                        at::tensor({1.5f, -2.0f, 3.25f})));

  at::Tensor kept = mapped.at("Float");
  const at::Tensor before = kept.clone();
  mapped.clear();
  kept.add_(1.0);
  EXPECT_TRUE(at::equal(kept, before + 1.0));
  EXPECT_TRUE(at::equal(load_safetensors(path).at("Float"), before));
}

// A model in two files and an index (Hugging Face's sharded layout) reads as the one model; an
// index that names a file elsewhere, puts a tensor in a file without it, leaves a file's tensor
// out or names a missing file is one Error naming the index or file.
TEST(Safetensors, AShardedModelReadsThroughItsIndex) {
  ScratchDir dir("safetensors-index");
  const at::Tensor a = at::randn({4, 3}), b = at::randn({5}), c = at::arange(6);
  save_safetensors({{"layer.0.weight", a}, {"layer.0.bias", b}},
                   dir.file("model-00001-of-00002.safetensors"));
  save_safetensors({{"head.weight", c}}, dir.file("model-00002-of-00002.safetensors"));
  auto index = [&](const std::string& weight_map) {
    const std::string path = dir.file("model.safetensors.index.json");
    std::ofstream(path, std::ios::trunc)
        << R"({"metadata": {"total_size": 132}, "weight_map": {)" << weight_map << "}}\n";
    return path;
  };
  const std::string whole =
      R"("layer.0.weight": "model-00001-of-00002.safetensors",
         "layer.0.bias": "model-00001-of-00002.safetensors",
         "head.weight": "model-00002-of-00002.safetensors")";
  const auto t = map_safetensors_index(index(whole));
  ASSERT_EQ(t.size(), 3u);
  EXPECT_TRUE(at::equal(t.at("layer.0.weight"), a));
  EXPECT_TRUE(at::equal(t.at("layer.0.bias"), b));
  EXPECT_TRUE(at::equal(t.at("head.weight"), c));
  EXPECT_TRUE(is_safetensors_index_path(dir.file("model.safetensors.index.json")));
  EXPECT_FALSE(is_safetensors_index_path(dir.file("model.safetensors")));
  EXPECT_FALSE(is_safetensors_index_path(dir.file(".safetensors.index.json")));
  EXPECT_TRUE(is_weights_index_path(dir.file("model.safetensors.index.json")));
  EXPECT_TRUE(is_weights_index_path(dir.file("pytorch_model.bin.index.json")));
  EXPECT_FALSE(is_weights_index_path(dir.file("pytorch_model.bin")));
  EXPECT_FALSE(is_weights_index_path(dir.file("data.index.json")));

  const std::string path = dir.file("model.safetensors.index.json");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"("layer.0.weight": "../model-00001-of-00002.safetensors")",
       "'layer.0.weight' is in '../model-00001-of-00002.safetensors', which is not a file name "
       "beside the index"},
      {R"("layer.0.weight": "model-00002-of-00002.safetensors")",
       "it puts 'layer.0.weight' in model-00002-of-00002.safetensors, which does not hold it"},
      {R"("head.weight": "model-00002-of-00002.safetensors",
          "layer.0.weight": "model-00001-of-00002.safetensors")",
       "model-00001-of-00002.safetensors holds 'layer.0.bias', which the index does not list"},
      {R"("head.weight": 3)", "the file of 'head.weight' is not a string"},
      {R"("head.weight": "model-00003-of-00002.safetensors")",
       path + ": " + dir.file("model-00003-of-00002.safetensors") + " does not exist"}};
  for (const auto& [entries, expected] : cases) {
    const std::string& weight_map = entries;  // a lambda may not capture a structured binding
    const std::string e = error_of([&] { map_safetensors_index(index(weight_map)); });
    EXPECT_NE(e.find(expected), std::string::npos) << expected << "\n got: " << e;
  }
  std::ofstream(path, std::ios::trunc) << R"({"metadata": {}})";
  EXPECT_EQ(error_of([&] { map_safetensors_index(path); }),
            path +
                ": not a safetensors index: it has no \"weight_map\" object (tensor name -> "
                "file)");
}

TEST(Safetensors, TellsItsFilesApart) {
  EXPECT_TRUE(looks_like_safetensors(encode_safetensors({{"w", at::zeros({1})}})));
  EXPECT_FALSE(looks_like_safetensors(std::string("PK\x03\x04", 4) + std::string(8, '\0')));
  EXPECT_FALSE(looks_like_safetensors("FUSEBOX-CKPT"));
  EXPECT_FALSE(looks_like_safetensors("{}"));
  EXPECT_TRUE(is_safetensors_path("a/b.safetensors"));
  EXPECT_FALSE(is_safetensors_path("a/b.safetensors.pt"));

  // A checkpoint's first bytes, read from the file, tell it from safetensors and back.
  ScratchDir dir("safetensors-kinds");
  Checkpoint ckpt;
  ckpt.model["w"] = at::zeros({2});
  save_checkpoint(ckpt, dir.file("c.fbx"));
  save_safetensors({{"w", at::zeros({2})}}, dir.file("w.safetensors"));
  EXPECT_TRUE(looks_like_checkpoint(read_file_head(dir.file("c.fbx"))));
  EXPECT_FALSE(looks_like_safetensors(read_file_head(dir.file("c.fbx"))));
  EXPECT_TRUE(looks_like_safetensors(read_file_head(dir.file("w.safetensors"))));
  EXPECT_FALSE(looks_like_checkpoint(read_file_head(dir.file("w.safetensors"))));
  EXPECT_EQ(read_file_head(dir.file("missing")), "");
  EXPECT_EQ(read_file_head(dir.file("c.fbx"), 4), "FUSE");
}

// Saving streams the file: the peak resident memory does not grow by the tensors' size (the whole
// file built in memory first would), and the file is what encode_safetensors() gives.
TEST(Safetensors, SavingHoldsNoCopyOfTheFile) {
  using fusebox::testing::peak_growth_kib;
  ScratchDir dir("safetensors-stream");
  const std::string path = dir.file("w.safetensors");
  const at::Tensor w = at::rand({32, 1024, 1024});  // 128 MiB
  const std::vector<std::pair<std::string, at::Tensor>> tensors = {{"w", w},
                                                                   {"b", at::arange(3.0)}};
  const std::optional<long long> grew = peak_growth_kib([&] { save_safetensors(tensors, path); });
  EXPECT_LT(grew.value_or(0), 16 * 1024) << "KiB";
  EXPECT_TRUE(file_bytes(path) == encode_safetensors(tensors));
}
