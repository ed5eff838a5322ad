#include "cli/train/metrics.h"

#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>

#include <sys/stat.h>

#include "util/errors.h"
#include "util/fs.h"
#include "util/logging.h"

namespace strata {

namespace {

// The lines of `path` a run resumed after `step` continues from: those of
// steps up to it, as written; those after it, and a last line cut short (the
// earlier run killed mid-write), dropped. Only when something changes: the
// file as it was kept as PATH.prev, then rewritten atomically with its mode.
void keep_lines_through(const std::string& path, int64_t step) {
  if (!path_exists(path)) return;
  const std::string text = file_contents(path);
  std::string kept;
  int64_t dropped = 0;
  size_t at = 0;
  while (at < text.size()) {
    const size_t end = text.find('\n', at);
    const bool last = end == std::string::npos;
    const std::string line = text.substr(at, last ? std::string::npos : end - at);
    at = last ? text.size() : end + 1;
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    const bool later = j.is_object() && j.contains("step") && j["step"].is_number_integer() &&
                       j["step"].get<int64_t>() > step;
    if (later || (last && j.is_discarded())) {
      ++dropped;
      continue;
    }
    kept += line;
    kept += '\n';
  }
  if (kept == text) return;
  struct stat st{};
  const bool have_mode = ::stat(path.c_str(), &st) == 0;
  write_file_atomic(path + ".prev", text);
  write_file_atomic(path, kept);
  if (have_mode) ::chmod(path.c_str(), st.st_mode & 07777);
  if (dropped > 0) {
    log::info("metrics: %lld line(s) after step %lld dropped from %s (this run writes those steps again; the file "
              "as it was: %s.prev)",
              (long long)dropped, (long long)step, path.c_str(), path.c_str());
  }
}

}  // namespace

MetricsWriter::MetricsWriter(const std::string& path, bool append, int64_t resumed_step) : path_(path) {
  if (path.empty()) return;
  make_dirs(parent_dir(path));
  if (append && resumed_step >= 0) keep_lines_through(path, resumed_step);
  out_.open(path, std::ios::out | (append ? std::ios::app : std::ios::trunc));
  if (!out_) throw InputError(path, std::string("cannot open metrics file for writing: ") + std::strerror(errno));
}

void MetricsWriter::write(const nlohmann::json& j) {
  if (!out_.is_open()) return;
  out_ << j.dump() << '\n';
  out_.flush();
  if (!out_) throw IoError(path_, errno, "cannot write metrics");
}

nlohmann::json step_line(const StepResult& r, const StepTiming& t) {
  const double tokens_per_s = double(r.tokens) / t.step_s;
  nlohmann::json line = {
      {"step", t.step},
      {"loss", r.loss},
      {"lr", r.lr},
      {"grad_norm", r.grad_norm},
      {"tokens", r.tokens},
      {"tokens_per_s", tokens_per_s},
      {"flops_per_s", tokens_per_s * t.flops_per_token},
      {"step_s", t.step_s},
      {"bound_s", t.bound_s},
      {"elapsed_s", t.elapsed_s},
      {"h2d_bytes", r.links.h2d},
      {"d2h_bytes", r.links.d2h},
      {"nvme_read_bytes", r.links.nvme_read},
      {"nvme_write_bytes", r.links.nvme_write},
      {"wait_s", r.wait_s},
      {"optimizer_s", r.optimizer_s},
      {"optimizer_wait_s", r.optimizer_wait_s},
      {"checkpoint_wait_s", r.checkpoint_wait_s},
      {"peak_device_bytes", t.peak[0]},
      {"peak_host_bytes", t.peak[1]},
      {"peak_nvme_bytes", t.peak[2]},
      {"world_size", t.world_size},
      {"net_bytes", r.net_bytes},
      {"intra_node_bytes", r.intra_node_bytes},
      {"comm_wait_s", r.comm_wait_s},
  };
  if (t.masked) line["counted_tokens"] = r.counted_tokens;
  if (t.truncated >= 0) line["truncated_examples"] = t.truncated;
  if (!r.expert_load.empty()) {  // experts (docs/metrics.md)
    line["aux_loss"] = r.aux_loss;
    line["expert_load"] = r.expert_load;
  }
  if (!r.speculation.empty()) {
    // Note [Speculative optimizer] in engine/optimizer/optimizer_pass.h.
    line["speculation"] = r.speculation;
    line["optimizer_hidden_s"] = r.optimizer_hidden_s;
    line["redone_elements"] = r.redone_elements;
  }
  if (t.loss_scaled) {
    line["loss_scale"] = r.loss_scale;
    line["skipped"] = r.skipped;
  }
  return line;
}

std::map<std::string, double> numeric_fields(const nlohmann::json& line) {
  std::map<std::string, double> figures;
  for (const auto& [k, v] : line.items()) {
    // A NaN or infinity (a skipped fp16 step's grad_norm) is null in the line: no point (docs/monitors.md).
    if (v.is_number() && std::isfinite(v.get<double>())) figures[k] = v.get<double>();
  }
  return figures;
}

}  // namespace strata
