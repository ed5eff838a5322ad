#include "checkpoint/checkpoint.h"

#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "comm/communicator.h"
#include "nvme/crc32c.h"
#include "nvme/file.h"
#include "util/errors.h"
#include "util/fs.h"
#include "util/kill_hook.h"
#include "util/logging.h"

namespace strata {

namespace {

using nlohmann::json;

constexpr int64_t kAlign = nvme::kDirectAlignmentBytes;
constexpr int kSaveThreadNice = 10;

int64_t round_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

const char* saved_name(Category c) { return category_name(c); }

bool parse_category(const std::string& s, Category* out) {
  for (Category c : kSavedCategories) {
    if (s == saved_name(c)) {
      *out = c;
      return true;
    }
  }
  return false;
}

[[noreturn]] void bad(const std::string& path, const std::string& key, const std::string& what) {
  throw InputError(path, "manifest " + key + ": " + what);
}

// A name a manifest may use for a data file: plain, inside the directory.
bool plain_name(const std::string& n) {
  return !n.empty() && n != "." && n != ".." && n.find('/') == std::string::npos &&
         n.find('\0') == std::string::npos;
}

const json& member(const json& j, const char* key, const std::string& path, const std::string& where) {
  if (!j.is_object() || !j.contains(key)) bad(path, where.empty() ? key : where + "." + key, "missing");
  return j[key];
}

int64_t integer(const json& j, const char* key, const std::string& path, const std::string& where) {
  const json& v = member(j, key, path, where);
  if (!v.is_number_integer()) bad(path, where.empty() ? key : where + "." + key, "expected an integer");
  return v.get<int64_t>();
}

json range_to_json(const SavedRange& r) {
  return {{"category", saved_name(r.category)}, {"start", r.start}, {"numel", r.numel},
          {"file", r.file},                     {"offset", r.offset}, {"crc32c", r.crc}};
}

// Ranges in manifest order: by category, then start.
void sort_ranges(std::vector<SavedRange>& ranges) {
  std::stable_sort(ranges.begin(), ranges.end(), [](const SavedRange& a, const SavedRange& b) {
    return a.category != b.category ? a.category < b.category : a.start < b.start;
  });
}

std::string rank_file(int rank, const char* ext) { return strprintf("rank-%05d.%s", rank, ext); }

std::string file_name_for_log(const std::string& dir, int rank) { return dir + "/" + rank_file(rank, "bin"); }

std::string step_name(int64_t step) { return strprintf("step-%08lld", (long long)step); }

// What a rank reports of a phase of the save: empty when it succeeded.
struct PhaseStatus {
  std::string error;
};

// Agrees on whether a phase succeeded everywhere. Throws on every rank when
// one failed: the failing rank with its own message, the others naming the
// highest-numbered rank that failed.
void agree(Communicator& comm, const PhaseStatus& mine, const char* phase) {
  const int64_t failed = failed_rank(comm, !mine.error.empty());
  if (failed < 0) return;
  if (!mine.error.empty()) throw Error("checkpoint save failed (" + std::string(phase) + "): " + mine.error);
  throw Error(strprintf("checkpoint save failed (%s) on rank %lld; see its message", phase, (long long)failed));
}

}  // namespace

// ---- fault hook -----------------------------------------------------------------

namespace {
struct KillSpec {
  std::string event;
  int64_t k = 0, save = 1;
};
const KillSpec& kill_spec() {
  static const KillSpec spec = [] {
    KillSpec s;
    const KillAt at = kill_at_from_env("STRATA_CHECKPOINT_KILL_AT");
    if (at.event.empty()) return s;
    s.event = at.event;
    s.k = at.numbers.at(0);
    if (at.numbers.size() > 1) s.save = at.numbers[1];
    return s;
  }();
  return spec;
}
std::atomic<int64_t> g_saves{0};   // saves begun by this process
std::atomic<int64_t> g_events{0};  // events of the kind named, in the current save
}  // namespace

void checkpoint_fault_point(const char* event) {
  const KillSpec& spec = kill_spec();
  if (spec.event.empty() || spec.event != event || g_saves.load() != spec.save) return;
  if (++g_events == spec.k) ::kill(::getpid(), SIGKILL);
}

// ---- manifest -------------------------------------------------------------------

json manifest_to_json(const Manifest& m) {
  json tensors = json::array();
  for (const TensorEntry& t : m.tensors) tensors.push_back({{"name", t.name}, {"shape", t.shape}, {"start", t.start}});
  json dtypes = json::object();
  for (const auto& [c, eb] : m.elem_bytes) dtypes[saved_name(c)] = eb == 4 ? "fp32" : "bf16";
  json ranges = json::array();
  for (const SavedRange& r : m.ranges) ranges.push_back(range_to_json(r));
  json files = json::object();
  for (const auto& [name, bytes] : m.files) files[name] = bytes;
  return {{"format", "strata-checkpoint"},
          {"version", kCheckpointVersion},
          {"step", m.step},
          {"saved_world_size", m.saved_world_size},
          {"parameters", m.parameters},
          {"tensors", tensors},
          {"dtypes", dtypes},
          {"checksum_bytes", kChecksumBytes},
          {"files", files},
          {"ranges", ranges},
          {"trainer", m.trainer},
          {"data", m.data},
          {"invariants", m.invariants},
          {"config", m.config}};
}

Manifest manifest_from_json(const json& j, const std::string& path) {
  if (!j.is_object()) bad(path, "(top level)", "expected a JSON object");
  if (!j.contains("format") || j["format"] != "strata-checkpoint") {
    bad(path, "format", "not a Strata checkpoint manifest");
  }
  const int64_t version = integer(j, "version", path, "");
  if (version != kCheckpointVersion) {
    bad(path, "version", strprintf("%lld is not supported (this build reads version %d)", (long long)version,
                                   kCheckpointVersion));
  }
  if (integer(j, "checksum_bytes", path, "") != kChecksumBytes) bad(path, "checksum_bytes", "must be 1048576");
  Manifest m;
  m.step = integer(j, "step", path, "");
  if (m.step < 1) bad(path, "step", "must be positive");
  m.saved_world_size = integer(j, "saved_world_size", path, "");
  m.parameters = integer(j, "parameters", path, "");
  if (m.parameters < 1) bad(path, "parameters", "must be positive");
  const json& tensors = member(j, "tensors", path, "");
  if (!tensors.is_array()) bad(path, "tensors", "expected an array");
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::string where = strprintf("tensors[%zu]", i);
    TensorEntry t;
    const json& name = member(tensors[i], "name", path, where);
    if (!name.is_string()) bad(path, where + ".name", "expected a string");
    t.name = name.get<std::string>();
    const json& shape = member(tensors[i], "shape", path, where);
    if (!shape.is_array()) bad(path, where + ".shape", "expected an array");
    for (const json& d : shape) {
      if (!d.is_number_integer() || d.get<int64_t>() < 1) bad(path, where + ".shape", "expected positive integers");
      t.shape.push_back(d.get<int64_t>());
    }
    t.start = integer(tensors[i], "start", path, where);
    m.tensors.push_back(std::move(t));
  }
  const json& dtypes = member(j, "dtypes", path, "");
  for (Category c : kSavedCategories) {
    const json& d = member(dtypes, saved_name(c), path, "dtypes");
    if (d == "fp32") {
      m.elem_bytes[c] = 4;
    } else if (d == "bf16" && c != Category::kMaster) {
      m.elem_bytes[c] = 2;
    } else {
      bad(path, std::string("dtypes.") + saved_name(c), "expected \"fp32\"" +
                                                            std::string(c == Category::kMaster ? "" : " or \"bf16\""));
    }
  }
  const json& files = member(j, "files", path, "");
  if (!files.is_object()) bad(path, "files", "expected an object");
  for (auto it = files.begin(); it != files.end(); ++it) {
    if (!plain_name(it.key())) {
      bad(path, "files", "'" + it.key() + "' is not a plain file name inside the checkpoint directory");
    }
    if (!it->is_number_integer() || it->get<int64_t>() < 0) bad(path, "files." + it.key(), "expected a byte count");
    m.files[it.key()] = it->get<int64_t>();
  }
  const json& ranges = member(j, "ranges", path, "");
  if (!ranges.is_array()) bad(path, "ranges", "expected an array");
  for (size_t i = 0; i < ranges.size(); ++i) {
    const std::string where = strprintf("ranges[%zu]", i);
    const json& r = ranges[i];
    SavedRange s;
    const json& cat = member(r, "category", path, where);
    if (!cat.is_string() || !parse_category(cat.get<std::string>(), &s.category)) {
      bad(path, where + ".category", "expected master, exp_avg or exp_avg_sq");
    }
    s.start = integer(r, "start", path, where);
    s.numel = integer(r, "numel", path, where);
    s.offset = integer(r, "offset", path, where);
    const json& file = member(r, "file", path, where);
    if (!file.is_string() || !plain_name(file.get<std::string>())) {
      bad(path, where + ".file", "'" + (file.is_string() ? file.get<std::string>() : file.dump()) +
                                     "' is not a plain file name inside the checkpoint directory");
    }
    s.file = file.get<std::string>();
    if (!m.files.count(s.file)) bad(path, where + ".file", "'" + s.file + "' is not listed in files");
    if (s.start < 0 || s.numel < 1 || s.start + s.numel > m.parameters) {
      bad(path, where, "start and numel must lie inside the parameters");
    }
    const int64_t bytes = s.numel * m.elem_bytes[s.category];
    if (s.offset < 0 || s.offset % kAlign != 0 || s.offset + round_up(bytes, kAlign) > m.files[s.file]) {
      bad(path, where + ".offset", "must be a multiple of 4096 inside the file");
    }
    const json& crc = member(r, "crc32c", path, where);
    if (!crc.is_array() || int64_t(crc.size()) != (bytes + kChecksumBytes - 1) / kChecksumBytes) {
      bad(path, where + ".crc32c", "expected one CRC-32C per MiB of the range");
    }
    for (const json& v : crc) {
      if (!v.is_number_unsigned() || v.get<uint64_t>() > 0xffffffffULL) bad(path, where + ".crc32c", "expected 32-bit values");
      s.crc.push_back(uint32_t(v.get<uint64_t>()));
    }
    m.ranges.push_back(std::move(s));
  }
  sort_ranges(m.ranges);
  // Every saved category is tiled exactly: no gap, no overlap.
  for (Category c : kSavedCategories) {
    int64_t next = 0;
    for (const SavedRange& r : m.ranges) {
      if (r.category != c) continue;
      if (r.start != next) {
        bad(path, "ranges", strprintf("%s elements %lld.. are %s", saved_name(c), (long long)std::min(next, r.start),
                                      r.start > next ? "missing" : "saved twice"));
      }
      next = r.start + r.numel;
    }
    if (next != m.parameters) {
      bad(path, "ranges", strprintf("%s elements %lld.. are missing", saved_name(c), (long long)next));
    }
  }
  if (j.contains("trainer")) m.trainer = j["trainer"];
  if (j.contains("data")) m.data = j["data"];
  if (j.contains("config")) m.config = j["config"];
  if (j.contains("invariants")) m.invariants = j["invariants"];
  return m;
}

// ---- writing ---------------------------------------------------------------------

RankFileWriter::RankFileWriter(const std::string& dir, const std::string& file,
                               const std::vector<ShardRange>& ranges, const std::map<Category, int>& elem_bytes,
                               const nvme::EngineOptions& engine)
    : path_(dir + "/" + file), file_(file), ranges_(ranges), elem_bytes_(elem_bytes) {
  int64_t total = 0;
  for (const ShardRange& r : ranges_) total += round_up(r.numel * elem_bytes_.at(r.category), kAlign);
  nvme::OpenOptions o;
  o.write = true;
  o.create = true;
  o.exclusive = true;
  nvme::File f = nvme::File::open(path_, o);
  if (total > 0) f.preallocate(total);  // ENOSPC shows here, before any byte is written
  slots_ = HostBuffer(size_t(kWriterSlots * kWriterSlotBytes), "checkpoint write staging");
  nvme::EngineOptions eo = engine;
  eo.fixed_buffers = {{slots_.data(), int64_t(slots_.bytes())}};
  engine_ = std::make_unique<nvme::IoEngine>(eo);
  id_ = engine_->attach(std::move(f));
  saved_.reserve(ranges_.size());
}

RankFileWriter::~RankFileWriter() {
  for (Pending& p : pending_) p.handle.wait_ok();
  if (engine_ && id_.valid()) engine_->detach(id_);
}

void RankFileWriter::pop_front() {
  Pending p = std::move(pending_.front());
  pending_.pop_front();
  if (p.slot >= 0) slot_busy_[size_t(p.slot)] = false;
  const auto t0 = std::chrono::steady_clock::now();
  p.handle.wait();
  wait_s_ += seconds_since(t0);
}

int RankFileWriter::acquire_slot() {
  const int k = next_slot_;
  next_slot_ = (next_slot_ + 1) % kWriterSlots;
  while (slot_busy_[size_t(k)]) pop_front();  // FIFO: everything before its last write
  return k;
}

void RankFileWriter::submit(size_t range, int slot, int64_t offset, int64_t bytes, const std::byte* buf) {
  checkpoint_fault_point("write");
  Pending p;
  p.range = range;
  p.slot = slot;
  if (slot >= 0) slot_busy_[size_t(slot)] = true;
  p.handle = engine_->submit(
      nvme::IoRequest{nvme::IoOp::kWrite, id_, offset, bytes, const_cast<std::byte*>(buf)});
  pending_.push_back(std::move(p));
}

void RankFileWriter::write(size_t i, const RangeSource& source) {
  STRATA_CHECK(i == next_range_, "checkpoint ranges are written in order");
  ++next_range_;
  const ShardRange& r = ranges_.at(i);
  const int eb = elem_bytes_.at(r.category);
  const int64_t bytes = r.numel * eb;
  SavedRange s;
  s.category = r.category;
  s.start = r.start;
  s.numel = r.numel;
  s.file = file_;
  s.offset = at_;
  s.crc.resize(size_t((bytes + kChecksumBytes - 1) / kChecksumBytes));
  const std::byte* home = source.resident ? source.resident(i) : nullptr;
  if (home != nullptr && reinterpret_cast<uintptr_t>(home) % kAlign == 0) {
    // In place: the whole 4 KiB blocks from the home, the rest (and the zero
    // padding to 4 KiB, whatever the home holds after the range) staged.
    const int64_t body = bytes / kAlign * kAlign;
    if (body > 0) submit(i, -1, at_, body, home);
    in_place_bytes_ += body;
    if (body < bytes) {
      const int k = acquire_slot();
      std::memcpy(slot(k), home + body, size_t(bytes - body));
      std::memset(slot(k) + (bytes - body), 0, size_t(kAlign - (bytes - body)));
      submit(i, k, at_ + body, kAlign, slot(k));
    }
    const auto t0 = std::chrono::steady_clock::now();
    nvme::crc32c_blocks(home, size_t(bytes), size_t(kChecksumBytes), s.crc.data());
    crc_s_ += seconds_since(t0);
  } else {
    // Staged, one slot at a time: pieces of whole MiB (whole checksum blocks)
    // and whole kShardAlignElems.
    const int64_t piece = kWriterSlotBytes / eb;
    for (int64_t at = 0; at < r.numel; at += piece) {
      const int64_t n = std::min(piece, r.shard_numel - at);  // what the tier reads
      const int64_t real = std::min(piece, r.numel - at) * eb;  // what the file keeps
      const int64_t padded = round_up(real, kAlign);
      const int k = acquire_slot();
      if (progress_) progress_(std::min(written_ranges(), i));  // (range i itself is not)
      auto t0 = std::chrono::steady_clock::now();
      source.fill(i, at, n, slot(k));
      fill_s_ += seconds_since(t0);
      std::memset(slot(k) + real, 0, size_t(padded - real));  // zero padding, whatever the tier held
      t0 = std::chrono::steady_clock::now();
      nvme::crc32c_blocks(slot(k), size_t(real), size_t(kChecksumBytes),
                          s.crc.data() + at * eb / kChecksumBytes);
      crc_s_ += seconds_since(t0);
      submit(i, k, at_ + at * eb, padded, slot(k));
    }
  }
  at_ += round_up(bytes, kAlign);
  saved_.push_back(std::move(s));
}

void RankFileWriter::wait_through(size_t i) {
  while (!pending_.empty() && pending_.front().range <= i) pop_front();
}

size_t RankFileWriter::written_ranges() {
  while (!pending_.empty() && pending_.front().handle.done()) pop_front();
  return pending_.empty() ? next_range_ : pending_.front().range;
}

std::vector<SavedRange> RankFileWriter::finish() {
  while (!pending_.empty()) pop_front();
  nvme::File f = engine_->detach(id_);
  id_ = nvme::FileId();
  checkpoint_fault_point("fsync");
  const auto t0 = std::chrono::steady_clock::now();
  f.sync();
  f.close();
  sync_s_ += seconds_since(t0);
  return std::move(saved_);
}

// ---- reading ---------------------------------------------------------------------

CheckpointReader::CheckpointReader(const std::string& dir, const nvme::EngineOptions& engine) : dir_(dir) {
  const std::string mpath = dir + "/manifest.json";
  if (!path_exists(mpath)) {
    throw InputError(mpath, "missing: not a complete checkpoint directory");
  }
  const std::string text = file_contents(mpath);
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) throw InputError(mpath, "not valid JSON (the manifest is corrupted)");
  manifest_ = manifest_from_json(j, mpath);
  for (const auto& [name, bytes] : manifest_.files) {
    const std::string p = dir + "/" + name;
    struct stat st;
    if (::lstat(p.c_str(), &st) != 0) throw InputError(p, "missing: the checkpoint is incomplete");
    if (!S_ISREG(st.st_mode)) throw InputError(p, "not a regular file");
    if (int64_t(st.st_size) < bytes) {
      throw InputError(p, strprintf("truncated: %lld bytes, the manifest says %lld", (long long)st.st_size,
                                    (long long)bytes));
    }
  }
  nvme::EngineOptions o = engine;
  o.max_files = std::max<int>(o.max_files, int(std::min<size_t>(manifest_.files.size(), 4096)));
  scratch_ = HostBuffer(size_t(kReaderSlots * kReaderSlotBytes), "checkpoint read staging");
  o.fixed_buffers = {{scratch_.data(), int64_t(scratch_.bytes())}};
  engine_ = std::make_unique<nvme::IoEngine>(o);
}

CheckpointReader::~CheckpointReader() {
  for (auto& [name, id] : open_) engine_->detach(id);
}

nvme::FileId CheckpointReader::file(const std::string& name) {
  auto it = open_.find(name);
  if (it != open_.end()) return it->second;
  nvme::OpenOptions o;
  nvme::FileId id = engine_->attach(nvme::File::open(dir_ + "/" + name, o));
  open_[name] = id;
  return id;
}

namespace {

// A piece of a read: whole checksum blocks [first_block, first_block +
// blocks) of one saved range, read into a slot, verified, and the bytes
// [copy_lo, copy_hi) of the range copied to out_offset of target `target`.
struct ReadPiece {
  size_t target = 0;
  const SavedRange* range = nullptr;
  int64_t first_block = 0, blocks = 0;
  int64_t from = 0, to = 0;  // range bytes read (from is block-aligned)
  int64_t copy_lo = 0, copy_hi = 0;
  int64_t out_offset = 0;
};

}  // namespace

void CheckpointReader::read_all(const std::vector<Target>& targets, const std::function<void(size_t)>& done) {
  const int64_t slot_blocks = kReaderSlotBytes / kChecksumBytes;
  std::vector<ReadPiece> pieces;
  for (size_t t = 0; t < targets.size(); ++t) {
    const Target& tg = targets[t];
    const int eb = elem_bytes(tg.category);
    const int64_t end = tg.start + tg.numel;
    // The first range that ends after `start` (ranges are sorted and tile).
    auto it = std::lower_bound(manifest_.ranges.begin(), manifest_.ranges.end(), std::make_pair(tg.category, tg.start),
                               [](const SavedRange& r, const std::pair<Category, int64_t>& k) {
                                 return r.category != k.first ? r.category < k.first
                                                              : r.start + r.numel <= k.second;
                               });
    for (int64_t at = tg.start; at < end; ++it) {
      STRATA_CHECK(it != manifest_.ranges.end() && it->category == tg.category && it->start <= at,
                   "checkpoint ranges do not cover a read");
      const SavedRange& r = *it;
      const int64_t hi = std::min(end, r.start + r.numel);
      const int64_t range_bytes = r.numel * eb;
      int64_t b_lo = (at - r.start) * eb;
      const int64_t b_hi = (hi - r.start) * eb;
      for (int64_t k = b_lo / kChecksumBytes; k * kChecksumBytes < b_hi;) {
        ReadPiece p;
        p.target = t;
        p.range = &r;
        p.first_block = k;
        p.blocks = std::min((b_hi - k * kChecksumBytes + kChecksumBytes - 1) / kChecksumBytes, slot_blocks);
        p.from = k * kChecksumBytes;
        p.to = std::min(range_bytes, (k + p.blocks) * kChecksumBytes);
        p.copy_lo = std::max(b_lo, p.from);
        p.copy_hi = std::min(b_hi, p.to);
        p.out_offset = (r.start - tg.start) * eb + p.copy_lo;
        pieces.push_back(p);
        k += p.blocks;
        b_lo = p.copy_hi;
      }
      at = hi;
    }
  }
  // The last piece of each target: done() follows it.
  std::vector<size_t> last(targets.size(), SIZE_MAX);
  for (size_t i = 0; i < pieces.size(); ++i) last[pieces[i].target] = i;

  std::vector<nvme::IoHandle> inflight(kReaderSlots);
  auto slot = [&](size_t i) { return scratch_.as<std::byte>() + int64_t(i % kReaderSlots) * kReaderSlotBytes; };
  // A piece read straight into its target's own buffer: whole, aligned, inside it.
  auto direct = [&](const ReadPiece& p) -> std::byte* {
    const Target& t = targets[p.target];
    std::byte* dst = t.out + p.out_offset;
    if (t.own_bytes <= 0 || p.copy_lo != p.from || reinterpret_cast<uintptr_t>(dst) % kAlign != 0 ||
        p.out_offset + round_up(p.to - p.from, kAlign) > t.own_bytes) {
      return nullptr;
    }
    return dst;
  };
  auto issue = [&](size_t i) {
    const ReadPiece& p = pieces[i];
    std::byte* dst = direct(p);
    inflight[i % kReaderSlots] = engine_->submit(nvme::IoRequest{nvme::IoOp::kRead, file(p.range->file),
                                                                 p.range->offset + p.from,
                                                                 round_up(p.to - p.from, kAlign),
                                                                 dst != nullptr ? dst : slot(i)});
  };
  for (size_t i = 0; i < pieces.size() && i < size_t(kReaderSlots); ++i) issue(i);
  for (size_t i = 0; i < pieces.size(); ++i) {
    const ReadPiece& p = pieces[i];
    const SavedRange& r = *p.range;
    const std::string fpath = dir_ + "/" + r.file;
    try {
      nvme::IoHandle h = std::move(inflight[i % kReaderSlots]);
      h.wait();
    } catch (const IoError& e) {
      throw InputError(fpath, std::string("cannot read: ") + e.what());
    }
    std::byte* in_place = direct(p);
    const std::byte* s = in_place != nullptr ? in_place : slot(i);
    for (int64_t q = 0; q < p.blocks; ++q) {
      const int64_t qb = std::min(kChecksumBytes, p.to - p.from - q * kChecksumBytes);
      if (nvme::crc32c(s + q * kChecksumBytes, size_t(qb)) != r.crc[size_t(p.first_block + q)]) {
        throw InputError(fpath, strprintf("checksum mismatch in bytes %lld..%lld (the file is corrupted)",
                                          (long long)(r.offset + p.from + q * kChecksumBytes),
                                          (long long)(r.offset + p.from + q * kChecksumBytes + qb)));
      }
    }
    if (in_place == nullptr) {
      std::memcpy(targets[p.target].out + p.out_offset, s + (p.copy_lo - p.from), size_t(p.copy_hi - p.copy_lo));
    }
    if (i + kReaderSlots < pieces.size()) issue(i + kReaderSlots);  // the slot is free again
    if (last[p.target] == i && done) done(p.target);
  }
  for (size_t t = 0; t < targets.size(); ++t) {
    if (last[t] == SIZE_MAX && done) done(t);  // empty targets
  }
}

// ---- the protocol ----------------------------------------------------------------

std::string resolve_checkpoint(const std::string& dir) {
  if (!is_directory(dir)) throw InputError(dir, "no such checkpoint directory");
  if (path_exists(dir + "/manifest.json")) return dir;
  const std::string latest = dir + "/latest";
  if (!path_exists(latest)) {
    throw InputError(dir, "no checkpoint to resume from (neither a manifest.json nor a 'latest' file)");
  }
  std::string name = file_contents(latest);
  while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
  if (!plain_name(name)) throw InputError(latest, "'" + name + "' is not a checkpoint directory name");
  const std::string target = dir + "/" + name;
  if (!is_directory(target)) throw InputError(latest, "names '" + name + "', which does not exist");
  return target;
}

namespace {

// Removes pruned checkpoints on a thread of its own; the next save (or the
// process's exit) waits for it first.
class BackgroundPruner {
 public:
  ~BackgroundPruner() { wait(); }
  void wait() {
    if (thread_.joinable()) thread_.join();
  }
  void start(std::vector<std::string> dirs) {
    wait();
    if (dirs.empty()) return;
    thread_ = std::thread([dirs = std::move(dirs)] {
      for (const std::string& d : dirs) {
        try {
          remove_tree(d);
        } catch (const std::exception& e) {
          log::warn("checkpoint: cannot remove %s: %s (the next save retries)", d.c_str(), e.what());
        }
      }
    });
  }

 private:
  std::thread thread_;
};

BackgroundPruner& background_pruner() {
  static BackgroundPruner p;
  return p;
}

// Rank 0, once every rank's part is written: the manifest, the rename, latest, pruning.
std::string publish(const CheckpointOptions& options, Manifest m, int world, const std::string& tmp,
                    const std::string& final_dir) {
  json parts = json::array();
  for (int r = 0; r < world; ++r) {
    const std::string part = tmp + "/" + rank_file(r, "json");
    const json j = json::parse(file_contents(part), nullptr, false);
    if (j.is_discarded() || !j.contains("ranges") || !j.contains("bytes")) {
      throw InputError(part, "a rank's part of the manifest is malformed");
    }
    m.files[rank_file(r, "bin")] = j["bytes"].get<int64_t>();
    for (const json& x : j["ranges"]) parts.push_back(x);
  }
  // The parts parsed, sorted and checked as a load will: what is about to be
  // published must read back.
  json whole = manifest_to_json(m);
  whole["ranges"] = std::move(parts);
  m = manifest_from_json(whole, tmp + "/manifest.json");
  checkpoint_fault_point("fsync");
  write_file_atomic(tmp + "/manifest.json", manifest_to_json(m).dump(1) + "\n");
  for (int r = 0; r < world; ++r) remove_file(tmp + "/" + rank_file(r, "json"));
  checkpoint_fault_point("fsync");
  sync_dir(tmp);
  // A checkpoint of this step already there (a resume from an earlier one)
  // is replaced: moved aside, the new one renamed in, the old one removed.
  std::string aside;
  if (path_exists(final_dir)) {
    aside = final_dir + ".old.tmp";
    remove_tree(aside);
    rename_path(final_dir, aside);
  }
  checkpoint_fault_point("rename");
  rename_path(tmp, final_dir);
  checkpoint_fault_point("fsync");
  sync_dir(options.dir);
  checkpoint_fault_point("latest");
  write_file_atomic(options.dir + "/latest", step_name(m.step) + "\n");
  if (!aside.empty()) remove_tree(aside);
  // Prune: complete checkpoints beyond the newest `keep`, and leftovers of
  // crashed saves. Only now that the new one is complete and latest names it.
  std::vector<std::string> complete;
  for (const std::string& n : list_dir(options.dir)) {
    const bool step_dir = n.rfind("step-", 0) == 0;
    if (!step_dir) continue;
    if (n.size() > 4 && n.compare(n.size() - 4, 4, ".tmp") == 0) {
      remove_tree(options.dir + "/" + n);
      continue;
    }
    if (is_directory(options.dir + "/" + n) && path_exists(options.dir + "/" + n + "/manifest.json")) {
      complete.push_back(n);
    }
  }
  std::sort(complete.begin(), complete.end());  // 8-digit steps sort in step order
  const std::string keep_name = step_name(m.step);
  int64_t kept = 0;
  std::vector<std::string> pruning;
  for (auto it = complete.rbegin(); it != complete.rend(); ++it) {
    if (*it == keep_name || kept < options.keep - 1) {
      if (*it != keep_name) ++kept;
      continue;
    }
    // Renamed out of the way at once (a .tmp name: a crash leaves it to the
    // next save), removed in the background: on a file system mounted with
    // `discard`, freeing a large file takes about a second per GB.
    const std::string doomed = options.dir + "/" + *it + ".pruned.tmp";
    rename_path(options.dir + "/" + *it, doomed);
    log::info("checkpoint: removing %s/%s (keeping the newest %lld)", options.dir.c_str(), it->c_str(),
              (long long)options.keep);
    pruning.push_back(doomed);
  }
  background_pruner().start(std::move(pruning));
  return final_dir;
}

std::string error_text(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "unknown error";
  }
}

}  // namespace

void wait_for_checkpoint_pruning() { background_pruner().wait(); }

CheckpointSave::CheckpointSave(const CheckpointOptions& options, Communicator& comm, Manifest header,
                               std::vector<ShardRange> ranges, RangeSource source, std::function<bool(size_t)> ready,
                               SnapshotPool pool)
    : options_(options), comm_(comm), header_(std::move(header)), ranges_(std::move(ranges)),
      source_(std::move(source)), ready_(std::move(ready)), pool_(source_.snapshot ? pool : SnapshotPool()),
      t0_(std::chrono::steady_clock::now()) {
  const int rank = comm.rank();
  STRATA_CHECK(reinterpret_cast<uintptr_t>(pool_.data) % kAlign == 0, "a snapshot pool not 4 KiB aligned");
  snap_state_.assign(ranges_.size(), Snap::kNone);
  snap_ok_.assign(ranges_.size(), 0);
  if (pool_.bytes > 0) {
    for (size_t i = 0; i < ranges_.size(); ++i) snap_ok_[i] = !source_.snapshot_ok || source_.snapshot_ok(i);
  }
  reserved_.reserve(ranges_.size());
  snap_.assign(ranges_.size(), nullptr);
  // A range taken into the pool is written from there: in place (the pool
  // is aligned), or its pieces copied.
  from_pool_.resident = [this](size_t i) -> const std::byte* { return snap_[i]; };
  from_pool_.fill = [this](size_t i, int64_t at, int64_t numel, std::byte* buf) {
    const int eb = header_.elem_bytes.at(ranges_[i].category);
    std::memcpy(buf, snap_[i] + at * eb, size_t(numel * eb));
  };
  step_ = header_.step;
  const std::string name = step_name(step_);
  tmp_ = options_.dir + "/" + name + ".tmp";
  final_dir_ = options_.dir + "/" + name;
  header_.saved_world_size = comm.world_size();
  for (const ShardRange& r : ranges_) bytes_ += r.numel * header_.elem_bytes.at(r.category);
  background_pruner().wait();  // the last save's pruning, off the disk before this one writes
  ++g_saves;
  g_events = 0;
  PhaseStatus st;
  if (rank == 0) {
    try {
      make_dirs(options_.dir, 0700);
      remove_tree(tmp_);
      if (::mkdir(tmp_.c_str(), 0700) != 0) throw IoError(tmp_, errno, "cannot create checkpoint directory");
    } catch (...) {
      st.error = error_text(std::current_exception());
    }
  }
  agree(comm, st, "creating the directory");
  thread_ = std::thread([this] { run(); });
}

CheckpointSave::~CheckpointSave() {
  if (thread_.joinable()) thread_.join();
}

void CheckpointSave::run() {
  const int rank = comm_.rank();
  if (ready_) {
    // Saving while training: the checksums and the copies yield the CPU to
    // the step (a hint; Linux applies nice per thread).
    ::setpriority(PRIO_PROCESS, pid_t(::syscall(SYS_gettid)), kSaveThreadNice);
  }
  std::string error;
  try {
    const auto t0 = std::chrono::steady_clock::now();
    RankFileWriter w(tmp_, rank_file(rank, "bin"), ranges_, header_.elem_bytes, options_.engine);
    const double setup_s = seconds_since(t0);
    double ready_s = 0.0;
    auto publish = [&](size_t n) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (n <= written_) return;
        written_ = n;
      }
      cv_.notify_all();
    };
    w.set_progress(publish);
    for (size_t i = 0; i < ranges_.size(); ++i) {
      if (options_.test_delay_per_range_ms > 0) {
        std::this_thread::sleep_for(std::chrono::milliseconds(options_.test_delay_per_range_ms));
      }
      if (ready_) {
        const auto t1 = std::chrono::steady_clock::now();
        if (!ready_(i)) throw Error("the optimizer step being saved failed");
        ready_s += seconds_since(t1);
      }
      bool pooled;
      {
        // A snapshot being taken finishes first (Note [Save snapshots]);
        // once begun, the range is this thread's.
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return snap_state_[i] != Snap::kCopying; });
        begun_ = i + 1;
        pooled = snap_state_[i] == Snap::kTaken;
      }
      w.write(i, pooled ? from_pool_ : source_);
      publish(w.written_ranges());
    }
    for (size_t i = 0; i < ranges_.size(); ++i) {
      w.wait_through(i);
      publish(i + 1);
    }
    const std::vector<SavedRange> saved = w.finish();
    struct rusage cpu {};
    ::getrusage(RUSAGE_THREAD, &cpu);
    auto tv = [](const timeval& t) { return double(t.tv_sec) + 1e-6 * double(t.tv_usec); };
    log::debug("checkpoint: rank %d wrote %s in %.3f s: set-up %.3f s, waiting for the optimizer %.3f s, tier "
               "reads %.3f s, checksums %.3f s, waiting for writes %.3f s, fsync %.3f s (%s written in place, "
               "%s of it from the snapshot pool; the thread used %.3f s user, %.3f s system CPU)",
               rank, file_name_for_log(tmp_, rank).c_str(), seconds_since(t0), setup_s, ready_s, w.fill_s(),
               w.crc_s(), w.wait_s(), w.sync_s(), format_bytes(double(w.in_place_bytes())).c_str(),
               format_bytes(double(snapshot_bytes())).c_str(), tv(cpu.ru_utime), tv(cpu.ru_stime));
    json part = {{"bytes", int64_t(0)}, {"ranges", json::array()}};
    int64_t bytes = 0;
    for (const SavedRange& s : saved) {
      part["ranges"].push_back(range_to_json(s));
      bytes = std::max(bytes, s.offset + round_up(s.numel * header_.elem_bytes.at(s.category), kAlign));
    }
    part["bytes"] = bytes;
    checkpoint_fault_point("fsync");
    write_file_atomic(tmp_ + "/" + rank_file(rank, "json"), part.dump() + "\n");
  } catch (...) {
    error = error_text(std::current_exception());  // the writer has drained: no I/O from a home remains
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    error_ = std::move(error);
    written_ = ranges_.size();  // written, or abandoned: nothing waits on a failed save
    done_ = true;
    write_s_ = seconds_since(t0_);
  }
  cv_.notify_all();
}

bool CheckpointSave::reserve_locked(size_t i, std::vector<std::pair<size_t, std::byte*>>& out) {
  const int64_t bytes = round_up(ranges_[i].shard_numel * header_.elem_bytes.at(ranges_[i].category), kAlign);
  if (!snap_ok_[i] || i < begun_ || done_ || snap_state_[i] != Snap::kNone || pool_used_ + bytes > pool_.bytes) {
    return false;
  }
  out.push_back({i, pool_.data + pool_used_});
  pool_used_ += bytes;
  snap_state_[i] = Snap::kCopying;  // the save's thread waits for it
  return true;
}

void CheckpointSave::copy_reserved(std::unique_lock<std::mutex>& lock,
                                   const std::vector<std::pair<size_t, std::byte*>>& reserved) {
  lock.unlock();
  size_t k = 0;
  try {
    for (; k < reserved.size(); ++k) {
      {
        std::lock_guard<std::mutex> state(mu_);
        if (done_) break;  // failed: nothing waits for these (and the pool may soon be the next save's)
      }
      source_.snapshot(reserved[k].first, reserved[k].second);
      {
        std::lock_guard<std::mutex> state(mu_);
        const size_t i = reserved[k].first;
        snap_[i] = reserved[k].second;
        snap_state_[i] = Snap::kTaken;
        snapshot_bytes_ += ranges_[i].numel * header_.elem_bytes.at(ranges_[i].category);
      }
      cv_.notify_all();  // in order: the save's thread goes on with each
    }
  } catch (...) {
    lock.lock();
    // Homes not yet overwritten: the save reads those ranges there.
    for (; k < reserved.size(); ++k) snap_state_[reserved[k].first] = Snap::kNone;
    cv_.notify_all();
    throw;
  }
  lock.lock();
  for (; k < reserved.size(); ++k) snap_state_[reserved[k].first] = Snap::kNone;  // after a failed save
  cv_.notify_all();
}

double CheckpointSave::make_writable(size_t lo, size_t hi) {
  hi = std::min(hi, ranges_.size());
  double waited = 0.0;
  std::lock_guard<std::mutex> one_caller(callers_mu_);
  std::vector<std::pair<size_t, std::byte*>>& reserved = reserved_;
  std::unique_lock<std::mutex> lock(mu_);
  for (size_t i = lo; i < hi; ++i) {
    if (i < written_ || done_ || snap_state_[i] == Snap::kTaken) continue;
    reserved.clear();
    if (reserve_locked(i, reserved)) {
      copy_reserved(lock, reserved);  // Note [Save snapshots]: ours to copy
      continue;
    }
    if (snap_state_[i] == Snap::kNone && i < begun_) {
      // The save is at this range: this pass has caught up with it. Rather
      // than follow it at the disk's pace range by range, take every later
      // range it has not begun (the rest of this piece's too), while the
      // pool has room, in its order (it writes each as soon as it is
      // copied), then wait for the ones it has.
      for (size_t k = std::max(i + 1, begun_); k < ranges_.size() && pool_used_ < pool_.bytes; ++k) {
        reserve_locked(k, reserved);  // not those taken, on NVMe, or too large for what is left
      }
      if (!reserved.empty()) copy_reserved(lock, reserved);
    }
    // Begun by the save, being copied by another thread, or no room left.
    const auto t0 = std::chrono::steady_clock::now();
    cv_.wait(lock, [&] { return written_ > i || done_ || snap_state_[i] == Snap::kTaken; });
    waited += seconds_since(t0);
  }
  return waited;
}

int64_t CheckpointSave::snapshot_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return snapshot_bytes_;
}

bool CheckpointSave::done_everywhere() {
  bool done;
  {
    std::lock_guard<std::mutex> lock(mu_);
    done = done_;
  }
  return failed_rank(comm_, !done) < 0;
}

std::string CheckpointSave::finish() {
  STRATA_CHECK(!finished_, "a checkpoint save is finished once");
  finished_ = true;
  thread_.join();
  const int rank = comm_.rank();
  PhaseStatus st;
  st.error = error_;
  try {
    agree(comm_, st, "writing the state");
  } catch (...) {
    if (rank == 0) {
      try {
        remove_tree(tmp_);
      } catch (...) {
      }
    }
    throw;
  }
  if (rank == 0) {
    try {
      publish(options_, std::move(header_), comm_.world_size(), tmp_, final_dir_);
    } catch (...) {
      st.error = error_text(std::current_exception());
      try {
        remove_tree(tmp_);
      } catch (...) {
      }
    }
  }
  agree(comm_, st, "publishing");
  return final_dir_;
}

std::string save_checkpoint(const CheckpointOptions& options, Communicator& comm, Manifest header,
                            const std::vector<ShardRange>& ranges, const RangeSource& source) {
  CheckpointSave save(options, comm, std::move(header), ranges, source);
  return save.finish();
}

}  // namespace strata
