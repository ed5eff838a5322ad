// The protocol that makes a save complete (rank 0: manifest, rename, latest,
// pruning in the background) and its fault hook, STRATA_CHECKPOINT_KILL_AT
// (docs/checkpoint.md).
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <thread>

#include "checkpoint/internal.h"
#include "util/errors.h"
#include "util/fs.h"
#include "util/kill_hook.h"

namespace strata {

using namespace ckpt;  // NOLINT: this module's own helpers (checkpoint/internal.h)

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

void ckpt::note_save_begun() {
  ++g_saves;
  g_events = 0;
}

void checkpoint_fault_point(const char* event) {
  const KillSpec& spec = kill_spec();
  if (spec.event.empty() || spec.event != event || g_saves.load() != spec.save) return;
  if (++g_events == spec.k) ::kill(::getpid(), SIGKILL);
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

}  // namespace

std::string ckpt::publish(const CheckpointOptions& options, Manifest m, int world, const std::string& tmp,
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

void wait_for_checkpoint_pruning() { background_pruner().wait(); }

}  // namespace strata
