// DeepSpeed's tensorboard and csv_monitor (monitors.h; docs/monitors.md).
#include "cli/monitors.h"

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>

#include "nvme/crc32c.h"
#include "util/errors.h"
#include "util/fs.h"
#include "util/logging.h"

namespace strata {

namespace {

// ---- Note [Event files]: the few protobuf encodings an Event needs ----------

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(char(uint8_t(v) | 0x80));
    v >>= 7;
  }
  out.push_back(char(uint8_t(v)));
}

template <typename T>
void put_le(std::string& out, T v) {
  unsigned char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));  // x86-64 and every host Strata builds on are little-endian
  out.append(reinterpret_cast<const char*>(b), sizeof(T));
}

// A length-delimited field (wire type 2).
void put_bytes(std::string& out, int field, const std::string& bytes) {
  put_varint(out, uint64_t(field) << 3 | 2);
  put_varint(out, bytes.size());
  out += bytes;
}

// Event.wall_time (field 1, double, wire type 1).
std::string event_header(double wall_time) {
  std::string e;
  put_varint(e, 1 << 3 | 1);
  put_le(e, wall_time);
  return e;
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// TFRecord's checksum: CRC-32C rotated right by 15 bits plus a constant.
uint32_t masked_crc(const void* p, size_t n) {
  const uint32_t c = nvme::crc32c(p, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::string host_name() {
  char h[256] = {};
  if (::gethostname(h, sizeof(h) - 1) != 0) return "localhost";
  return h;
}

// A CSV file name for `tag`: '/' and ' ' become '_', as DeepSpeed's csv_monitor.
std::string csv_name(const std::string& tag) {
  std::string n = tag;
  for (char& ch : n) {
    if (ch == '/' || ch == ' ') ch = '_';
  }
  return n + ".csv";
}

std::atomic<int> g_event_files{0};

}  // namespace

// ---- EventFileWriter ------------------------------------------------------------

EventFileWriter::EventFileWriter(const std::string& dir) {
  make_dirs(dir);
  path_ = strprintf("%s/events.out.tfevents.%010lld.%s.%d.%d", dir.c_str(), (long long)now_seconds(),
                    host_name().c_str(), int(::getpid()), g_event_files.fetch_add(1));
  f_ = std::fopen(path_.c_str(), "wb");
  if (f_ == nullptr) throw IoError(path_, errno, "cannot create the TensorBoard event file");
  std::string first = event_header(now_seconds());
  put_bytes(first, 3, "brain.Event:2");  // Event.file_version
  try {
    record(first);
    if (std::fflush(f_) != 0) throw IoError(path_, errno, "cannot write the TensorBoard event file");
  } catch (...) {
    std::fclose(f_);  // the destructor will not run
    f_ = nullptr;
    throw;
  }
}

EventFileWriter::~EventFileWriter() {
  if (f_ != nullptr) std::fclose(f_);
}

void EventFileWriter::record(const std::string& event) {
  std::string r;
  const uint64_t n = event.size();
  put_le(r, n);
  put_le(r, masked_crc(r.data(), 8));
  r += event;
  put_le(r, masked_crc(event.data(), event.size()));
  if (std::fwrite(r.data(), 1, r.size(), f_) != r.size()) {
    throw IoError(path_, errno, "cannot write the TensorBoard event file");
  }
}

void EventFileWriter::scalars(int64_t step, const std::vector<std::pair<std::string, float>>& scalars) {
  std::string summary;
  for (const auto& [tag, value] : scalars) {
    std::string v;
    put_bytes(v, 1, tag);         // Summary.Value.tag
    put_varint(v, 2 << 3 | 5);    // Summary.Value.simple_value: float, wire type 5
    put_le(v, value);
    put_bytes(summary, 1, v);     // Summary.value (repeated)
  }
  std::string e = event_header(now_seconds());
  put_varint(e, 2 << 3 | 0);      // Event.step: int64 varint
  put_varint(e, uint64_t(step));
  put_bytes(e, 5, summary);       // Event.summary
  record(e);
  if (std::fflush(f_) != 0) throw IoError(path_, errno, "cannot write the TensorBoard event file");
}

// ---- CsvMonitorWriter -----------------------------------------------------------

CsvMonitorWriter::CsvMonitorWriter(const std::string& dir) : dir_(dir) { make_dirs(dir); }

CsvMonitorWriter::~CsvMonitorWriter() {
  for (auto& [tag, f] : files_) std::fclose(f);
}

void CsvMonitorWriter::scalars(int64_t step, const std::vector<std::pair<std::string, float>>& scalars) {
  for (const auto& [tag, value] : scalars) {
    const std::string path = dir_ + "/" + csv_name(tag);
    auto it = files_.find(tag);
    if (it == files_.end()) {
      struct stat st {};
      const bool fresh = ::stat(path.c_str(), &st) != 0 || st.st_size == 0;
      std::FILE* f = std::fopen(path.c_str(), "ab");
      if (f == nullptr) throw IoError(path, errno, "cannot open the csv_monitor file");
      it = files_.emplace(tag, f).first;
      if (fresh) {
        const size_t slash = tag.rfind('/');
        std::fprintf(f, "step,%s\r\n", (slash == std::string::npos ? tag : tag.substr(slash + 1)).c_str());
      }
    }
    // %.9g: a float's value exactly.
    if (std::fprintf(it->second, "%lld,%.9g\r\n", (long long)step, double(value)) < 0 || std::fflush(it->second) != 0) {
      throw IoError(path, errno, "cannot write the csv_monitor file");
    }
  }
}

// ---- Monitors ---------------------------------------------------------------------

const std::vector<std::pair<std::string, std::string>>& strata_monitor_tags() {
  // (metrics field, tag): DeepSpeed's where it has one.
  static const std::vector<std::pair<std::string, std::string>> tags = {
      {"loss", "Train/Samples/train_loss"},
      {"lr", "Train/Samples/lr"},
      {"loss_scale", "Train/Samples/loss_scale"},
      {"eval_loss", "Train/Samples/eval_loss"},
      {"grad_norm", "Strata/grad_norm"},
      {"tokens_per_s", "Strata/tokens_per_s"},
      {"flops_per_s", "Strata/flops_per_s"},
      {"step_s", "Strata/step_s"},
      {"bound_s", "Strata/bound_s"},
      {"h2d_bytes", "Strata/h2d_bytes"},
      {"d2h_bytes", "Strata/d2h_bytes"},
      {"nvme_read_bytes", "Strata/nvme_read_bytes"},
      {"nvme_write_bytes", "Strata/nvme_write_bytes"},
      {"net_bytes", "Strata/net_bytes"},
      {"wait_s", "Strata/wait_s"},
      {"optimizer_s", "Strata/optimizer_s"},
      {"optimizer_wait_s", "Strata/optimizer_wait_s"},
      {"comm_wait_s", "Strata/comm_wait_s"},
      {"optimizer_hidden_s", "Strata/optimizer_hidden_s"},
  };
  return tags;
}

Monitors::Monitors(const Config& cfg, bool rank0) {
  if (!rank0) return;
  if (cfg.tensorboard.enabled) tb_ = std::make_unique<EventFileWriter>(cfg.tensorboard.dir());
  if (cfg.csv_monitor.enabled) csv_ = std::make_unique<CsvMonitorWriter>(cfg.csv_monitor.dir());
}

std::vector<std::string> Monitors::dirs() const {
  std::vector<std::string> d;
  if (tb_) d.push_back("tensorboard: " + tb_->path());
  if (csv_) d.push_back("csv_monitor: " + csv_->dir() + "/<tag>.csv");
  return d;
}

void Monitors::write(int64_t x, const std::vector<std::pair<std::string, float>>& s) {
  if (s.empty()) return;
  if (tb_) tb_->scalars(x, s);
  if (csv_) csv_->scalars(x, s);
}

void Monitors::step(int64_t step, int64_t batch, const std::map<std::string, double>& figures) {
  if (!any()) return;
  std::vector<std::pair<std::string, float>> before, after;
  for (const auto& [field, tag] : strata_monitor_tags()) {
    auto it = figures.find(field);
    if (it == figures.end()) continue;
    (field == "loss" ? before : after).emplace_back(tag, float(it->second));
  }
  write((step - 1) * batch, before);  // DeepSpeed writes the loss before counting the step's samples
  write(step * batch, after);
}

}  // namespace strata
