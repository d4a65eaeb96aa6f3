#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/convert.h"
#include "io/safetensors.h"
#include "test_util.h"

namespace refit {
namespace {

// `text` contains `part` (gtest only: the suite does not link gmock).
::testing::AssertionResult Contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "\"" << text << "\"\n  does not contain \"" << part << "\"";
}
using testing::TempDir;

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string le64(std::uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xFF);
  return s;
}

// A safetensors file from raw header text (not padded here) and data bytes.
std::string raw_file(const std::string& header, const std::string& data) {
  return le64(header.size()) + header + data;
}

// The byte-exact file for tensor "a" = float32 [1.0, -2.0], assembled by hand from the format
// description: u64 LE header length 56, the 54-byte JSON header plus 2 spaces of padding, then
// 1.0f = 00 00 80 3F and -2.0f = 00 00 00 C0.
const std::string& hand_built_fixture() {
  static const std::string bytes = [] {
    std::string b("\x38\x00\x00\x00\x00\x00\x00\x00", 8);
    b += R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
    b += "  ";
    b += std::string("\x00\x00\x80\x3F\x00\x00\x00\xC0", 8);
    return b;
  }();
  return bytes;
}

template <typename T>
std::vector<T> read_as(const SafetensorsFile& f, const TensorInfo& info) {
  std::vector<T> v(static_cast<std::size_t>(info.numel()));
  std::memcpy(v.data(), f.data(info), info.nbytes());
  return v;
}

TEST(Safetensors, ReadsHandBuiltFile) {
  TempDir dir;
  const std::string path = dir.write("a.safetensors", hand_built_fixture());
  ASSERT_EQ(hand_built_fixture().size(), 72u);
  auto f = SafetensorsFile::open(path);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  ASSERT_EQ((*f)->tensors().size(), 1u);
  const TensorInfo* a = (*f)->find("a");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->dtype, DType::kFloat32);
  EXPECT_EQ(a->shape, (std::vector<std::int64_t>{2}));
  EXPECT_EQ(a->begin, 0u);
  EXPECT_EQ(a->end, 8u);
  EXPECT_EQ(read_as<float>(**f, *a), (std::vector<float>{1.0f, -2.0f}));
  EXPECT_TRUE((*f)->metadata().empty());
  EXPECT_EQ((*f)->find("b"), nullptr);
  EXPECT_EQ((*f)->path(), path);
}

TEST(Safetensors, WriterProducesTheHandBuiltBytes) {
  TempDir dir;
  const float a[] = {1.0f, -2.0f};
  const std::string path = dir.path() + "/w.safetensors";
  ASSERT_TRUE(write_safetensors(path, {{"a", DType::kFloat32, {2}, a}}).ok());
  EXPECT_EQ(read_file(path), hand_built_fixture());
  // No temporary file is left next to it.
  int entries = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir.path())) ++entries;
  EXPECT_EQ(entries, 1);
}

TEST(Safetensors, ReadsOtherWritersKeyOrderMetadataAndPadding) {
  // Metadata first, fields in another order, extra whitespace, header not a multiple of 8.
  TempDir dir;
  const std::string header =
      R"({ "__metadata__" : {"format":"pt"}, "b": {"shape":[3], "data_offsets":[2,8],)"
      R"( "dtype":"BF16"}, "z": {"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]} }   )";
  const std::string data("\x38\xB8\x80\x3F\x00\x40\x80\xBF", 8);  // fp8 1,-1; bf16 1,2,-1
  auto f = SafetensorsFile::open(dir.write("x.safetensors", raw_file(header, data)));
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  EXPECT_EQ((*f)->metadata(), (std::map<std::string, std::string>{{"format", "pt"}}));
  ASSERT_EQ((*f)->tensors().size(), 2u);
  EXPECT_EQ((*f)->tensors()[0].name, "z") << "tensors are listed in data order";
  const TensorInfo* b = (*f)->find("b");
  ASSERT_NE(b, nullptr);
  float out[3];
  TensorRef{f->get(), b}.read(out, DType::kFloat32);
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], 2.0f);
  EXPECT_EQ(out[2], -1.0f);
  TensorRef{f->get(), (*f)->find("z")}.read(out, DType::kFloat32);
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], -1.0f);
}

TEST(Safetensors, RoundTripsEveryDtypeAndShape) {
  TempDir dir;
  const float f32[] = {1.5f, -2.25f, 3.0f, 1e-30f, -0.0f, 65536.0f};
  std::uint16_t bf16[24];
  for (int i = 0; i < 24; ++i) bf16[i] = f32_to_bf16(static_cast<float>(i) - 7.5f);
  const std::uint16_t f16[] = {f32_to_f16(0.5f), f32_to_f16(-3.0f), 0x7C00};
  const std::uint8_t fp8[] = {0x38, 0xFE, 0x01, 0x7F};
  const float scalar = 42.0f;
  const std::vector<TensorView> views = {
      {"scalar", DType::kFloat32, {}, &scalar},
      {"vec.f32", DType::kFloat32, {6}, f32},
      {"cube.bf16", DType::kBFloat16, {2, 3, 4}, bf16},
      {"vec.f16", DType::kFloat16, {3}, f16},
      {"mat.fp8", DType::kFloat8E4M3, {2, 2}, fp8},
      {"empty", DType::kBFloat16, {0, 4}, nullptr},
  };
  const std::map<std::string, std::string> meta = {{"format", "pt"}, {"step", "17"}};
  const std::string path = dir.path() + "/all.safetensors";
  ASSERT_TRUE(write_safetensors(path, views, meta).ok());

  const std::string bytes = read_file(path);
  std::uint64_t header_len = 0;
  std::memcpy(&header_len, bytes.data(), 8);
  EXPECT_EQ(header_len % 8, 0u) << "data section is 8-byte aligned";

  auto f = SafetensorsFile::open(path);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  EXPECT_EQ((*f)->metadata(), meta);
  ASSERT_EQ((*f)->tensors().size(), views.size());
  for (const TensorView& v : views) {
    const TensorInfo* info = (*f)->find(v.name);
    ASSERT_NE(info, nullptr) << v.name;
    EXPECT_EQ(info->dtype, v.dtype) << v.name;
    EXPECT_EQ(info->shape, v.shape) << v.name;
    std::int64_t numel = 1;
    for (auto d : v.shape) numel *= d;
    EXPECT_EQ(info->numel(), numel);
    ASSERT_EQ(info->nbytes(), numel * dtype_size(v.dtype)) << v.name;
    if (numel > 0) {
      EXPECT_EQ(std::memcmp((*f)->data(*info), v.data, info->nbytes()), 0) << v.name;
    }
  }
  EXPECT_EQ((*f)->file_size(), bytes.size());
  // Reading with conversion, and a sub-range.
  TensorRef cube{f->get(), (*f)->find("cube.bf16")};
  float part[5];
  cube.read_range(10, 5, part, DType::kFloat32);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(part[i], static_cast<float>(10 + i) - 7.5f);
}

TEST(Safetensors, WriterRejectsBadInput) {
  TempDir dir;
  const float x[] = {1.0f};
  const std::string path = dir.path() + "/bad.safetensors";
  auto dup =
      write_safetensors(path, {{"w", DType::kFloat32, {1}, x}, {"w", DType::kFloat32, {1}, x}});
  EXPECT_EQ(dup.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(dup.message(), "\"w\""));
  EXPECT_FALSE(write_safetensors(path, {{"__metadata__", DType::kFloat32, {1}, x}}).ok());
  EXPECT_FALSE(write_safetensors(path, {{"n", DType::kFloat32, {-1}, x}}).ok());
  EXPECT_FALSE(write_safetensors(path, {{"n", DType::kFloat32, {4}, nullptr}}).ok());
  EXPECT_FALSE(std::filesystem::exists(path));
  auto no_dir = write_safetensors(dir.path() + "/missing/x.safetensors", {});
  EXPECT_EQ(no_dir.code(), StatusCode::kIOError);
  EXPECT_TRUE(Contains(no_dir.message(), "missing/x.safetensors"));
}

// ---- corrupt files: every error names the file (and the tensor where there is one) ----

struct BadFile {
  const char* what;
  std::string bytes;
  StatusCode code;
  std::vector<std::string> mentions;
};

TEST(Safetensors, RejectsCorruptFiles) {
  const std::string good_header = R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  const std::string data8(8, '\0');
  const std::vector<BadFile> cases = {
      {"empty file", "", StatusCode::kCorruption, {"0 bytes", "8-byte header length"}},
      {"shorter than the length prefix",
       std::string("\x10\x00\x00", 3),
       StatusCode::kCorruption,
       {"3 bytes"}},
      {"header length lying",
       le64(1000) + good_header + data8,
       StatusCode::kCorruption,
       {"header length 1000", "exceeds"}},
      {"corrupt JSON",
       raw_file(R"({"t":{"dtype":"F32",)", ""),
       StatusCode::kCorruption,
       {"invalid JSON"}},
      {"header not an object", raw_file("[1,2]", ""), StatusCode::kCorruption, {"array"}},
      {"truncated data",
       raw_file(good_header, std::string(5, '\0')),
       StatusCode::kCorruption,
       {"tensor t", "beyond the data section"}},
      {"span disagrees with shape",
       raw_file(R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", data8),
       StatusCode::kCorruption,
       {"tensor t", "needs 12 bytes"}},
      {"begin after end",
       raw_file(R"({"t":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", data8),
       StatusCode::kCorruption,
       {"tensor t", "[8, 0]"}},
      {"overlap",
       raw_file(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                R"("u":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                data8),
       StatusCode::kCorruption,
       {"overlaps", "tensor t", "tensor u"}},
      {"missing field",
       raw_file(R"({"t":{"dtype":"F32","shape":[2]}})", data8),
       StatusCode::kCorruption,
       {"tensor t", "data_offsets"}},
      {"negative dim",
       raw_file(R"({"t":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", data8),
       StatusCode::kCorruption,
       {"tensor t", "shape"}},
      {"fractional offset",
       raw_file(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8.5]}})", data8),
       StatusCode::kCorruption,
       {"tensor t", "data_offsets"}},
      {"unsupported dtype",
       raw_file(R"({"pos":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}})", data8),
       StatusCode::kUnsupported,
       {"tensor pos", "I64", "F32, BF16, F16, F8_E4M3"}},
      {"duplicate tensor",
       raw_file(R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                R"("t":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                data8),
       StatusCode::kCorruption,
       {"\"t\" appears twice"}},
      {"metadata value not a string",
       raw_file(
           R"({"__metadata__":{"step":3},"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
           data8),
       StatusCode::kCorruption,
       {"__metadata__", "step"}},
  };
  TempDir dir;
  for (const BadFile& c : cases) {
    const std::string path = dir.write("bad.safetensors", c.bytes);
    auto f = SafetensorsFile::open(path);
    ASSERT_FALSE(f.ok()) << c.what;
    EXPECT_EQ(f.status().code(), c.code) << c.what << ": " << f.status().to_string();
    EXPECT_TRUE(Contains(f.status().message(), path)) << c.what;
    for (const std::string& m : c.mentions) {
      EXPECT_TRUE(Contains(f.status().message(), m)) << c.what;
    }
  }
  auto missing = SafetensorsFile::open(dir.path() + "/nope.safetensors");
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(Contains(missing.status().message(), "nope.safetensors"));
}

TEST(Safetensors, EmptyHeaderObjectAndGapsAreValid) {
  TempDir dir;
  auto empty = SafetensorsFile::open(dir.write("e.safetensors", raw_file("{}", "")));
  ASSERT_TRUE(empty.ok()) << empty.status().to_string();
  EXPECT_TRUE((*empty)->tensors().empty());
  // A hole between tensors and trailing bytes are tolerated (never read).
  auto gap = SafetensorsFile::open(dir.write(
      "g.safetensors",
      raw_file(R"({"t":{"dtype":"F16","shape":[1],"data_offsets":[4,6]}})", std::string(9, 'x'))));
  ASSERT_TRUE(gap.ok()) << gap.status().to_string();
}

// ---- checkpoints ----

ModelSpec tiny_spec() {
  ModelConfig c;
  c.arch = Architecture::kLlama;
  c.hidden_size = 8;
  c.num_layers = 2;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.head_dim = 4;
  c.intermediate_size = 16;
  c.vocab_size = 10;
  c.tie_word_embeddings = true;
  return ModelSpec(c, "tiny-llama");
}

// Storage and views of a checkpoint that matches `spec` (float32 values i + tensor index).
struct SpecTensors {
  std::vector<std::vector<float>> storage;
  std::vector<TensorView> views;
};
SpecTensors make_tensors(const ModelSpec& spec) {
  SpecTensors out;
  out.storage.reserve(spec.tensors().size());
  for (std::size_t k = 0; k < spec.tensors().size(); ++k) {
    const TensorSpec& t = spec.tensors()[k];
    std::vector<float> v(static_cast<std::size_t>(t.numel()));
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i + 1000 * k);
    out.storage.push_back(std::move(v));
    out.views.push_back({t.name, DType::kFloat32, t.shape, out.storage.back().data()});
  }
  return out;
}

TEST(Checkpoint, SingleFileMatchesSpec) {
  TempDir dir;
  const ModelSpec spec = tiny_spec();
  auto t = make_tensors(spec);
  ASSERT_TRUE(write_checkpoint(dir.path(), t.views).ok());
  EXPECT_TRUE(std::filesystem::exists(dir.path() + "/model.safetensors"));
  auto ckpt = Checkpoint::open(dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().to_string();
  EXPECT_FALSE((*ckpt)->empty());
  EXPECT_EQ((*ckpt)->num_tensors(), spec.tensors().size());
  EXPECT_EQ((*ckpt)->files()[0]->metadata().at("format"), "pt");
  const Status s = (*ckpt)->check_against_spec(spec);
  EXPECT_TRUE(s.ok()) << s.to_string();
}

// A checkpoint truncated while it is mapped: reading a lost page ends the process with an error
// naming the file (exit 1) instead of killing it with SIGBUS (io/mapped_files.h).
TEST(Checkpoint, TruncatedWhileMappedIsAnErrorNamingTheFile) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "the sanitizer runtime owns SIGBUS";
#endif
  TempDir dir;
  const ModelSpec spec = tiny_spec();
  auto t = make_tensors(spec);
  ASSERT_TRUE(write_checkpoint(dir.path(), t.views).ok());
  const std::string path = dir.path() + "/model.safetensors";
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::dup2(fds[1], STDERR_FILENO);
    auto f = SafetensorsFile::open(path);
    if (!f.ok() || ::truncate(path.c_str(), 16) != 0) ::_exit(3);
    const TensorInfo& last = (*f)->tensors().back();
    const auto* p = reinterpret_cast<const volatile unsigned char*>((*f)->data(last));
    unsigned sum = 0;
    for (std::uint64_t i = 0; i < last.nbytes(); ++i) sum += p[i];
    ::_exit(sum == 12345 ? 4 : 0);  // never reached when the page is gone
  }
  ::close(fds[1]);
  std::string err;
  char buf[512];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) err.append(buf, static_cast<std::size_t>(n));
  ::close(fds[0]);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "signal " << (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
  EXPECT_EQ(WEXITSTATUS(status), 1) << err;
  EXPECT_NE(err.find("refit: error: " + path + " changed while refit was reading it"),
            std::string::npos)
      << err;
}

TEST(Checkpoint, ShardedWithIndex) {
  TempDir dir;
  const ModelSpec spec = tiny_spec();
  auto t = make_tensors(spec);
  // A tied-embedding checkpoint may still carry lm_head.weight: extra tensors are ignored.
  std::vector<float> head(10 * 8, 0.5f);
  t.views.push_back({"lm_head.weight", DType::kFloat32, {10, 8}, head.data()});
  ASSERT_TRUE(write_checkpoint(dir.path(), t.views, 3).ok());
  // A stray file the index does not name is not opened.
  dir.write("consolidated.safetensors", "garbage");

  const std::string index_text = read_file(dir.path() + "/model.safetensors.index.json");
  auto index = nlohmann::json::parse(index_text);
  std::uint64_t total = 0;
  for (const auto& v : t.views) total += 4 * TensorInfo{"", v.dtype, v.shape}.numel();
  EXPECT_EQ(index["metadata"]["total_size"].get<std::uint64_t>(), total);
  EXPECT_EQ(index["weight_map"]["model.embed_tokens.weight"], "model-00001-of-00003.safetensors");
  EXPECT_EQ(index["weight_map"]["lm_head.weight"], "model-00003-of-00003.safetensors");

  auto ckpt = Checkpoint::open(dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().to_string();
  EXPECT_EQ((*ckpt)->files().size(), 3u);
  EXPECT_EQ((*ckpt)->num_tensors(), spec.tensors().size() + 1);
  EXPECT_TRUE((*ckpt)->check_against_spec(spec).ok());
  for (std::size_t k = 0; k < spec.tensors().size(); ++k) {
    auto ref = (*ckpt)->find(spec.tensors()[k].name);
    ASSERT_TRUE(ref.ok()) << ref.status().to_string();
    std::vector<std::uint16_t> bf(static_cast<std::size_t>(ref->info->numel()));
    ref->read(bf.data(), DType::kBFloat16);
    for (std::size_t i = 0; i < bf.size(); ++i) {
      ASSERT_EQ(bf[i], f32_to_bf16(t.storage[k][i])) << spec.tensors()[k].name << " " << i;
    }
  }
  auto none = (*ckpt)->find("model.layers.9.mlp.up_proj.weight");
  EXPECT_EQ(none.status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(Contains(none.status().message(), "model.layers.9.mlp.up_proj.weight"));
}

TEST(Checkpoint, ShapeMismatchNamesFileAndTensor) {
  TempDir dir;
  const ModelSpec spec = tiny_spec();
  auto t = make_tensors(spec);
  const std::string bad = "model.layers.1.mlp.up_proj.weight";
  std::vector<float> wrong(32 * 4, 0.0f);
  for (auto& v : t.views) {
    if (v.name == bad) {
      v.shape = {32, 4};
      v.data = wrong.data();
    }
  }
  ASSERT_TRUE(write_checkpoint(dir.path(), t.views, 2).ok());
  auto ckpt = Checkpoint::open(dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().to_string();
  const Status s = (*ckpt)->check_against_spec(spec);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(s.message(), "model-00002-of-00002.safetensors: tensor " + bad +
                                        " has shape [32, 4], the model config says [16, 8]"));
  EXPECT_TRUE(Contains(s.message(), "tiny-llama"));
}

TEST(Checkpoint, MissingTensorIsNamed) {
  TempDir dir;
  const ModelSpec spec = tiny_spec();
  auto t = make_tensors(spec);
  t.views.erase(t.views.begin() + 3);
  ASSERT_TRUE(write_checkpoint(dir.path(), t.views).ok());
  auto ckpt = Checkpoint::open(dir.path());
  ASSERT_TRUE(ckpt.ok());
  const Status s = (*ckpt)->check_against_spec(spec);
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_TRUE(Contains(s.message(), "tensor " + spec.tensors()[3].name + " is missing"));
  EXPECT_TRUE(Contains(s.message(), dir.path()));
}

TEST(Checkpoint, ManyProblemsAreSummarised) {
  TempDir dir;
  const float x = 1.0f;
  ASSERT_TRUE(write_checkpoint(dir.path(), {{"other", DType::kFloat32, {1}, &x}}).ok());
  auto ckpt = Checkpoint::open(dir.path());
  ASSERT_TRUE(ckpt.ok());
  const ModelSpec spec = tiny_spec();
  const Status s = (*ckpt)->check_against_spec(spec);
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_TRUE(Contains(s.message(), "of " + std::to_string(spec.tensors().size()) + " tensors"));
  EXPECT_TRUE(Contains(s.message(), "more"));
}

TEST(Checkpoint, UnindexedFilesAndDuplicates) {
  TempDir dir;
  const float a[] = {1.0f, 2.0f};
  ASSERT_TRUE(
      write_safetensors(dir.path() + "/one.safetensors", {{"a", DType::kFloat32, {2}, a}}).ok());
  ASSERT_TRUE(
      write_safetensors(dir.path() + "/two.safetensors", {{"b", DType::kFloat32, {1}, a}}).ok());
  dir.write("notes.txt", "not a tensor file");
  {
    auto ckpt = Checkpoint::open(dir.path());
    ASSERT_TRUE(ckpt.ok()) << ckpt.status().to_string();
    EXPECT_EQ((*ckpt)->tensor_names(), (std::vector<std::string>{"a", "b"}));
    auto b = (*ckpt)->find("b");
    ASSERT_TRUE(b.ok());
    EXPECT_TRUE(Contains(b->file->path(), "two.safetensors"));
  }
  ASSERT_TRUE(
      write_safetensors(dir.path() + "/three.safetensors", {{"a", DType::kFloat32, {2}, a}}).ok());
  auto dup = Checkpoint::open(dir.path());
  ASSERT_FALSE(dup.ok());
  EXPECT_EQ(dup.status().code(), StatusCode::kCorruption);
  EXPECT_TRUE(Contains(dup.status().message(), "tensor a"));
  EXPECT_TRUE(Contains(dup.status().message(), "one.safetensors"));
  EXPECT_TRUE(Contains(dup.status().message(), "three.safetensors"));
}

TEST(Checkpoint, EmptyMissingAndBrokenDirectories) {
  TempDir dir;
  dir.write("config.json", "{}");
  auto empty = Checkpoint::open(dir.path());
  ASSERT_TRUE(empty.ok()) << empty.status().to_string();
  EXPECT_TRUE((*empty)->empty());
  EXPECT_EQ((*empty)->num_tensors(), 0u);

  auto missing = Checkpoint::open(dir.path() + "/nope");
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(Contains(missing.status().message(), "nope"));

  // A broken shard is reported with its path.
  TempDir broken;
  broken.write("model.safetensors", std::string("\x05\x00", 2));
  auto b = Checkpoint::open(broken.path());
  EXPECT_EQ(b.status().code(), StatusCode::kCorruption);
  EXPECT_TRUE(Contains(b.status().message(), broken.path() + "/model.safetensors"));
}

TEST(Checkpoint, InvalidIndexIsReported) {
  TempDir dir;
  const float a[] = {1.0f};
  ASSERT_TRUE(
      write_safetensors(dir.path() + "/s1.safetensors", {{"a", DType::kFloat32, {1}, a}}).ok());
  const std::string index = dir.path() + "/model.safetensors.index.json";

  dir.write("model.safetensors.index.json",
            R"({"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors"}})");
  auto lacks = Checkpoint::open(dir.path());
  EXPECT_EQ(lacks.status().code(), StatusCode::kCorruption);
  EXPECT_TRUE(Contains(lacks.status().message(), "tensor b"));
  EXPECT_TRUE(Contains(lacks.status().message(), "s1.safetensors"));

  dir.write("model.safetensors.index.json", R"({"weight_map": {"a": "s9.safetensors"}})");
  auto gone = Checkpoint::open(dir.path());
  EXPECT_EQ(gone.status().code(), StatusCode::kCorruption);
  EXPECT_TRUE(Contains(gone.status().message(), "s9.safetensors"));

  dir.write("model.safetensors.index.json", R"({"metadata": {}})");
  auto no_map = Checkpoint::open(dir.path());
  EXPECT_TRUE(Contains(no_map.status().message(), "weight_map"));
  EXPECT_TRUE(Contains(no_map.status().message(), index));

  dir.write("model.safetensors.index.json", "{not json");
  auto bad_json = Checkpoint::open(dir.path());
  EXPECT_TRUE(Contains(bad_json.status().message(), "invalid JSON"));
}

}  // namespace
}  // namespace refit
