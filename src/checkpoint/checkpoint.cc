#include "checkpoint/checkpoint.h"

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>

#include "comm/communicator.h"
#include "nvme/crc32c.h"
#include "nvme/file.h"
#include "util/errors.h"
#include "util/fs.h"
#include "util/logging.h"

namespace strata {

namespace {

using nlohmann::json;

constexpr int64_t kAlign = nvme::kDirectAlignmentBytes;
constexpr int64_t kScratchBytes = int64_t(64) << 20;  // reader: the most read at once

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
    const char* v = std::getenv("STRATA_CHECKPOINT_KILL_AT");
    if (v == nullptr) return s;
    const std::string t = v;
    const size_t a = t.find(':');
    if (a == std::string::npos) return s;
    s.event = t.substr(0, a);
    s.k = std::atoll(t.c_str() + a + 1);
    const size_t b = t.find(':', a + 1);
    if (b != std::string::npos) s.save = std::atoll(t.c_str() + b + 1);
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
  int64_t total = 0, largest = 0;
  for (const ShardRange& r : ranges_) {
    const int eb = elem_bytes_.at(r.category);
    total += round_up(r.numel * eb, kAlign);
    largest = std::max(largest, round_up(r.shard_numel * eb, kAlign));
  }
  nvme::OpenOptions o;
  o.write = true;
  o.create = true;
  o.exclusive = true;
  nvme::File f = nvme::File::open(path_, o);
  if (total > 0) f.preallocate(total);  // ENOSPC shows here, before any byte is written
  engine_ = std::make_unique<nvme::IoEngine>(engine);
  id_ = engine_->attach(std::move(f));
  if (largest > 0) {
    for (HostBuffer& b : buf_) b = HostBuffer(size_t(largest), "checkpoint staging");
  }
}

RankFileWriter::~RankFileWriter() {
  for (nvme::IoHandle& h : pending_) {
    if (h.valid()) h.wait_ok();
  }
  if (engine_ && id_.valid()) engine_->detach(id_);
}

std::byte* RankFileWriter::buffer(size_t i) {
  nvme::IoHandle& h = pending_[i % 2];
  if (h.valid()) {
    const auto t0 = std::chrono::steady_clock::now();
    nvme::IoHandle done = std::move(h);
    done.wait();
    wait_s_ += seconds_since(t0);
  }
  return buf_[i % 2].as<std::byte>();
}

void RankFileWriter::write(size_t i) {
  const ShardRange& r = ranges_.at(i);
  const int eb = elem_bytes_.at(r.category);
  const int64_t bytes = r.numel * eb;
  const int64_t padded = round_up(bytes, kAlign);
  std::byte* buf = buf_[i % 2].as<std::byte>();
  // The padding written after the range is zero, whatever the tier held.
  std::memset(buf + bytes, 0, size_t(padded - bytes));
  SavedRange s;
  s.category = r.category;
  s.start = r.start;
  s.numel = r.numel;
  s.file = file_;
  s.offset = at_;
  s.crc.resize(size_t((bytes + kChecksumBytes - 1) / kChecksumBytes));
  const auto t0 = std::chrono::steady_clock::now();
  nvme::crc32c_blocks(buf, size_t(bytes), size_t(kChecksumBytes), s.crc.data());
  crc_s_ += seconds_since(t0);
  checkpoint_fault_point("write");
  pending_[i % 2] = engine_->submit(nvme::IoRequest{nvme::IoOp::kWrite, id_, at_, padded, buf});
  at_ += padded;
  saved_.push_back(std::move(s));
}

std::vector<SavedRange> RankFileWriter::finish() {
  auto t0 = std::chrono::steady_clock::now();
  for (nvme::IoHandle& h : pending_) {
    if (h.valid()) {
      nvme::IoHandle done = std::move(h);
      done.wait();
    }
  }
  wait_s_ += seconds_since(t0);
  nvme::File f = engine_->detach(id_);
  id_ = nvme::FileId();
  checkpoint_fault_point("fsync");
  t0 = std::chrono::steady_clock::now();
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
  engine_ = std::make_unique<nvme::IoEngine>(o);
  scratch_ = HostBuffer(size_t(kScratchBytes), "checkpoint read staging");
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

void CheckpointReader::read(Category c, int64_t start, int64_t numel, std::byte* out) {
  const int eb = elem_bytes(c);
  const int64_t end = start + numel;
  // The first range that ends after `start` (ranges are sorted and tile).
  auto it = std::lower_bound(manifest_.ranges.begin(), manifest_.ranges.end(), std::make_pair(c, start),
                             [](const SavedRange& r, const std::pair<Category, int64_t>& k) {
                               return r.category != k.first ? r.category < k.first : r.start + r.numel <= k.second;
                             });
  int64_t at = start;
  for (; at < end; ++it) {
    STRATA_CHECK(it != manifest_.ranges.end() && it->category == c && it->start <= at,
                 "checkpoint ranges do not cover a read");
    const SavedRange& r = *it;
    const int64_t hi = std::min(end, r.start + r.numel);
    const int64_t range_bytes = r.numel * eb;
    // Whole checksum blocks covering [at, hi) of this range, at most the scratch at once.
    int64_t b_lo = (at - r.start) * eb, b_hi = (hi - r.start) * eb;
    int64_t k = b_lo / kChecksumBytes;
    while (k * kChecksumBytes < b_hi) {
      const int64_t blocks = std::min((b_hi - k * kChecksumBytes + kChecksumBytes - 1) / kChecksumBytes,
                                      kScratchBytes / kChecksumBytes);
      const int64_t from = k * kChecksumBytes;
      const int64_t to = std::min(range_bytes, (k + blocks) * kChecksumBytes);
      std::byte* s = scratch_.as<std::byte>();
      const std::string fpath = dir_ + "/" + r.file;
      try {
        engine_->read(file(r.file), r.offset + from, round_up(to - from, kAlign), s);
      } catch (const IoError& e) {
        throw InputError(fpath, std::string("cannot read: ") + e.what());
      }
      for (int64_t q = 0; q < blocks; ++q) {
        const int64_t qb = std::min(kChecksumBytes, to - from - q * kChecksumBytes);
        const uint32_t crc = nvme::crc32c(s + q * kChecksumBytes, size_t(qb));
        if (crc != r.crc[size_t(k + q)]) {
          throw InputError(fpath, strprintf("checksum mismatch in bytes %lld..%lld (the file is corrupted)",
                                            (long long)(r.offset + from + q * kChecksumBytes),
                                            (long long)(r.offset + from + q * kChecksumBytes + qb)));
        }
      }
      const int64_t copy_lo = std::max(b_lo, from), copy_hi = std::min(b_hi, to);
      std::memcpy(out + ((r.start - start) * eb + copy_lo), s + (copy_lo - from), size_t(copy_hi - copy_lo));
      k += blocks;
      b_lo = copy_hi;
    }
    at = hi;
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
  for (auto it = complete.rbegin(); it != complete.rend(); ++it) {
    if (*it == keep_name || kept < options.keep - 1) {
      if (*it != keep_name) ++kept;
      continue;
    }
    remove_tree(options.dir + "/" + *it);
    log::info("checkpoint: removed %s/%s (keeping the newest %lld)", options.dir.c_str(), it->c_str(),
              (long long)options.keep);
  }
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

std::string save_checkpoint(const CheckpointOptions& options, Communicator& comm, Manifest header,
                            const std::vector<ShardRange>& ranges,
                            const std::function<void(size_t, std::byte*)>& fill) {
  const int rank = comm.rank(), world = comm.world_size();
  const std::string name = step_name(header.step);
  const std::string tmp = options.dir + "/" + name + ".tmp";
  const std::string final_dir = options.dir + "/" + name;
  header.saved_world_size = world;
  ++g_saves;
  g_events = 0;

  PhaseStatus st;
  if (rank == 0) {
    try {
      make_dirs(options.dir, 0700);
      remove_tree(tmp);
      if (::mkdir(tmp.c_str(), 0700) != 0) throw IoError(tmp, errno, "cannot create checkpoint directory");
    } catch (...) {
      st.error = error_text(std::current_exception());
    }
  }
  agree(comm, st, "creating the directory");

  try {
    const auto t0 = std::chrono::steady_clock::now();
    RankFileWriter w(tmp, rank_file(rank, "bin"), ranges, header.elem_bytes, options.engine);
    const double setup_s = seconds_since(t0);
    double fill_s = 0.0;
    for (size_t i = 0; i < ranges.size(); ++i) {
      std::byte* buf = w.buffer(i);
      const auto t1 = std::chrono::steady_clock::now();
      fill(i, buf);
      fill_s += seconds_since(t1);
      w.write(i);
    }
    const std::vector<SavedRange> saved = w.finish();
    log::debug("checkpoint: rank %d wrote %s in %.3f s: set-up %.3f s, tier reads %.3f s, checksums %.3f s, "
               "waiting for writes %.3f s, fsync %.3f s",
               rank, file_name_for_log(tmp, rank).c_str(), seconds_since(t0), setup_s, fill_s, w.crc_s(), w.wait_s(),
               w.sync_s());
    json part = {{"bytes", int64_t(0)}, {"ranges", json::array()}};
    int64_t bytes = 0;
    for (const SavedRange& s : saved) {
      part["ranges"].push_back(range_to_json(s));
      bytes = std::max(bytes, s.offset + round_up(s.numel * header.elem_bytes.at(s.category), kAlign));
    }
    part["bytes"] = bytes;
    checkpoint_fault_point("fsync");
    write_file_atomic(tmp + "/" + rank_file(rank, "json"), part.dump() + "\n");
  } catch (...) {
    st.error = error_text(std::current_exception());
  }
  try {
    agree(comm, st, "writing the state");
  } catch (...) {
    if (rank == 0) {
      try {
        remove_tree(tmp);
      } catch (...) {
      }
    }
    throw;
  }

  std::string dir;
  if (rank == 0) {
    try {
      dir = publish(options, std::move(header), world, tmp, final_dir);
    } catch (...) {
      st.error = error_text(std::current_exception());
      try {
        remove_tree(tmp);
      } catch (...) {
      }
    }
  }
  agree(comm, st, "publishing");
  return final_dir;
}

}  // namespace strata
