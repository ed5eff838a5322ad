// Helpers shared by the checkpoint's files (checkpoint/ only): manifest.cc
// (the manifest's JSON), rank_files.cc (a rank's data file, written and
// read), publish.cc (the protocol that makes a save complete, and its fault
// hook) and checkpoint.cc (the save in flight). docs/checkpoint.md has the
// format.
#pragma once

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "nvme/file.h"
#include "util/logging.h"

namespace strata::ckpt {

using nlohmann::json;

inline constexpr int64_t kAlign = nvme::kDirectAlignmentBytes;

inline int64_t round_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

inline const char* saved_name(Category c) { return category_name(c); }
bool parse_category(const std::string& s, Category* out);

inline std::string rank_file(int rank, const char* ext) { return strprintf("rank-%05d.%s", rank, ext); }
inline std::string file_name_for_log(const std::string& dir, int rank) { return dir + "/" + rank_file(rank, "bin"); }
inline std::string step_name(int64_t step) { return strprintf("step-%08lld", (long long)step); }

// The manifest's JSON (manifest.cc): a bad field is an InputError naming
// the file and the key.
[[noreturn]] void bad(const std::string& path, const std::string& key, const std::string& what);
// A name a manifest may use for a data file: plain, inside the directory.
bool plain_name(const std::string& n);
json range_to_json(const SavedRange& r);
// Ranges in manifest order: by category, then start.
void sort_ranges(std::vector<SavedRange>& ranges);

// The protocol (publish.cc). Rank 0, once every rank's part is written: the
// manifest, the rename, latest, pruning (in the background). Returns the
// checkpoint's directory.
std::string publish(const CheckpointOptions& options, Manifest m, int world, const std::string& tmp,
                    const std::string& final_dir);
// A save begins: the fault hook counts its events from zero.
void note_save_begun();

}  // namespace strata::ckpt
