// A rank's data file of a checkpoint: RankFileWriter streams ranges into it
// with their CRC-32Cs, CheckpointReader reads and verifies them
// (docs/checkpoint.md); resolve_checkpoint finds the checkpoint to read.
#include <sys/stat.h>

#include <algorithm>
#include <cstring>

#include "checkpoint/internal.h"
#include "nvme/crc32c.h"
#include "util/errors.h"
#include "util/fs.h"

namespace strata {

using namespace ckpt;  // NOLINT: this module's own helpers (checkpoint/internal.h)

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

// The pieces `targets` are read in: whole checksum blocks of the saved
// ranges that cover them, at most `slot_bytes` each.
std::vector<ReadPiece> plan_reads(const Manifest& m, const std::vector<CheckpointReader::Target>& targets,
                                  int64_t slot_bytes) {
  const int64_t slot_blocks = slot_bytes / kChecksumBytes;
  std::vector<ReadPiece> pieces;
  for (size_t t = 0; t < targets.size(); ++t) {
    const CheckpointReader::Target& tg = targets[t];
    const int eb = m.elem_bytes.at(tg.category);
    const int64_t end = tg.start + tg.numel;
    // The first range that ends after `start` (ranges are sorted and tile).
    auto it = std::lower_bound(m.ranges.begin(), m.ranges.end(), std::make_pair(tg.category, tg.start),
                               [](const SavedRange& r, const std::pair<Category, int64_t>& k) {
                                 return r.category != k.first ? r.category < k.first
                                                              : r.start + r.numel <= k.second;
                               });
    for (int64_t at = tg.start; at < end; ++it) {
      STRATA_CHECK(it != m.ranges.end() && it->category == tg.category && it->start <= at,
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
  return pieces;
}

}  // namespace

void CheckpointReader::read_all(const std::vector<Target>& targets, const std::function<void(size_t)>& done) {
  const std::vector<ReadPiece> pieces = plan_reads(manifest_, targets, kReaderSlotBytes);
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

}  // namespace strata
