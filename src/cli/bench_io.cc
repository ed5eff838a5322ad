#include "cli/bench_io.h"

#include <algorithm>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/bench_stats.h"
#include "nvme/bench.h"
#include "util/errors.h"
#include "util/logging.h"
#include "util/progress.h"

namespace strata {

namespace {

struct BenchIoOptions {
  std::string dir;
  std::string file;
  int64_t size_mb = 1024;
  std::string block_size = "1M";
  int queue_depth = 32;
  int rings = 1;
  bool sweep = false;
  bool json = false;
  std::string backend = "auto";
  std::string direct = "auto";
  std::string ops = "write,read";
  int rounds = 1;
  bool overlap_events = true;
  bool single_submit = false;
  std::string submit_batch = "4M";
  bool fsync = false;
};

// "256K", "1M", "8MiB", "4096" -> bytes.
int64_t parse_size(const std::string& flag, const std::string& text) {
  size_t pos = 0;
  long long value = 0;
  try {
    value = std::stoll(text, &pos);
  } catch (const std::exception&) {
    throw ConfigError(flag, "not a size: '" + text + "'");
  }
  std::string unit = text.substr(pos);
  for (auto& c : unit) c = char(std::toupper(static_cast<unsigned char>(c)));
  int64_t scale = 1;
  if (unit == "" || unit == "B")
    scale = 1;
  else if (unit == "K" || unit == "KB" || unit == "KIB")
    scale = int64_t(1) << 10;
  else if (unit == "M" || unit == "MB" || unit == "MIB")
    scale = int64_t(1) << 20;
  else if (unit == "G" || unit == "GB" || unit == "GIB")
    scale = int64_t(1) << 30;
  else
    throw ConfigError(flag, "unknown unit in '" + text + "' (use K, M or G)");
  if (value <= 0) throw ConfigError(flag, "must be positive, got '" + text + "'");
  return int64_t(value) * scale;
}

std::string size_label(int64_t bytes) {
  if (bytes % (int64_t(1) << 20) == 0) return std::to_string(bytes >> 20) + "M";
  if (bytes % 1024 == 0) return std::to_string(bytes >> 10) + "K";
  return std::to_string(bytes);
}

struct Config {
  int64_t block_size_bytes;
  int queue_depth;
  int rings;
};

struct Measured {
  Config config;
  double write_gbps = 0;  // medians over rounds
  double read_gbps = 0;
  double both_gbps = 0;   // reading and writing at once, aggregate (--ops ...,both)
};

nlohmann::json to_json(const nvme::BenchResult& r, int round) {
  return {{"op", nvme::io_op_name(r.op)},
          {"block_size", r.block_size_bytes},
          {"queue_depth", r.queue_depth},
          {"rings", r.rings},
          {"bytes", r.bytes},
          {"seconds", r.seconds},
          {"gbps", r.gbps()},
          {"backend", r.backend},
          {"direct", r.direct},
          {"fixed_buffers", r.fixed_buffers},
          {"fsync", r.fsync},
          {"round", round}};
}

int run_bench_io(const BenchIoOptions& opt) {
  setup_logging("info", "");  // stderr: stdout carries the table or JSON
  nvme::BenchOptions bo;
  bo.dir = opt.dir;
  bo.file = opt.file;
  bo.fsync_writes = opt.fsync;
  if (opt.size_mb <= 0) throw ConfigError("--size-mb", "must be positive");
  bo.bytes = opt.size_mb << 20;
  if (!nvme::parse_backend_kind(opt.backend, &bo.backend)) {
    throw ConfigError("--backend", "must be auto, io_uring or threads, got '" + opt.backend + "'");
  }
  if (opt.direct == "auto")
    bo.direct = nvme::DirectIo::kAuto;
  else if (opt.direct == "require" || opt.direct == "on")
    bo.direct = nvme::DirectIo::kRequire;
  else if (opt.direct == "off")
    bo.direct = nvme::DirectIo::kOff;
  else
    throw ConfigError("--direct", "must be auto, require or off, got '" + opt.direct + "'");
  bool do_write = false, do_read = false, do_both = false;
  for (size_t at = 0; at <= opt.ops.size();) {
    const size_t comma = std::min(opt.ops.find(',', at), opt.ops.size());
    const std::string op = opt.ops.substr(at, comma - at);
    if (op == "write") do_write = true;
    else if (op == "read") do_read = true;
    else if (op == "both") do_both = true;
    else throw ConfigError("--ops", "'" + op + "' is not write, read or both");
    at = comma + 1;
  }
  if (do_both && !do_write) throw ConfigError("--ops", "both reads the file the write pass wrote: name write too");
  if (opt.rounds < 1) throw ConfigError("--rounds", "must be at least 1");
  const int64_t submit_batch_bytes =
      opt.submit_batch == "0" ? 0 : parse_size("--submit-batch", opt.submit_batch);

  std::vector<Config> configs;
  if (opt.sweep) {
    for (int64_t bs : {int64_t(256) << 10, int64_t(1) << 20, int64_t(4) << 20, int64_t(8) << 20}) {
      for (int qd : {8, 32, 128}) {
        for (int rings : {1, 2, 4}) configs.push_back({bs, qd, rings});
      }
    }
  } else {
    configs.push_back({parse_size("--block-size", opt.block_size), opt.queue_depth, opt.rings});
  }
  for (const Config& c : configs) {  // all checked before any I/O
    nvme::EngineOptions eo;
    eo.block_size_bytes = c.block_size_bytes;
    eo.queue_depth = c.queue_depth;
    eo.rings = c.rings;
    try {
      nvme::validate(eo);
    } catch (const ConfigError& e) {  // name the flag, not the config key
      const std::string flag = e.key() == "aio.block_size"    ? "--block-size"
                               : e.key() == "aio.queue_depth" ? "--queue-depth"
                                                              : "--rings";
      throw ConfigError(flag, std::string(e.what()).substr(e.key().size() + 2));
    }
  }

  nvme::IoBench bench(bo);
  std::unique_ptr<nvme::IoBench> second;  // the file written while `bench`'s is read (--ops both)
  if (do_both) second = std::make_unique<nvme::IoBench>(bo);
  std::vector<Measured> measured;
  if (!opt.json) {
    std::printf("bench-io: %s, %s per pass%s%s\n", bench.path().c_str(),
                format_bytes(double(bo.bytes)).c_str(),
                opt.rounds > 1 ? strprintf(", median of %d rounds", opt.rounds).c_str() : "",
                opt.fsync ? ", writes timed to the end of fdatasync" : "");
  }
  for (size_t ci = 0; ci < configs.size(); ++ci) {
    const Config& c = configs[ci];
    nvme::EngineOptions eo;
    eo.block_size_bytes = c.block_size_bytes;
    eo.queue_depth = c.queue_depth;
    eo.rings = c.rings;
    eo.overlap_events = opt.overlap_events;
    eo.single_submit = opt.single_submit;
    eo.submit_batch_bytes = submit_batch_bytes;
    std::vector<double> writes, reads, boths;
    std::string backend;
    bool direct = true;
    for (int round = 0; round < opt.rounds; ++round) {
      for (const nvme::IoOp op : {nvme::IoOp::kWrite, nvme::IoOp::kRead}) {
        if ((op == nvme::IoOp::kWrite && !do_write) || (op == nvme::IoOp::kRead && !do_read))
          continue;
        std::string label =
            strprintf("%s bs=%s qd=%d rings=%d", nvme::io_op_name(op),
                      size_label(c.block_size_bytes).c_str(), c.queue_depth, c.rings);
        if (configs.size() > 1) label = strprintf("[%zu/%zu] ", ci + 1, configs.size()) + label;
        ProgressBar bar(label, bo.bytes >> 20);
        const nvme::BenchResult r =
            bench.run(op, eo, [&](int64_t done, int64_t total) { bar.update(done >> 20, "MiB"); });
        bar.finish();
        backend = r.backend;
        direct = r.direct;
        (op == nvme::IoOp::kWrite ? writes : reads).push_back(r.gbps());
        if (opt.json) std::printf("%s\n", to_json(r, round).dump().c_str());
        std::fflush(stdout);
      }
      if (do_both) {
        // The written file read back while a second one is written.
        const nvme::BenchResult r = nvme::run_both(bench, *second, eo);
        boths.push_back(r.gbps());
        if (opt.json) {
          nlohmann::json j = to_json(r, round);
          j["op"] = "both";
          std::printf("%s\n", j.dump().c_str());
        }
        std::fflush(stdout);
      }
    }
    measured.push_back({c, median(writes), median(reads), median(boths)});
    if (!opt.json && ci == 0) {
      std::printf("backend %s, %s I/O\n", backend.c_str(), direct ? "direct" : "buffered");
      std::printf("%8s %6s %6s %12s %12s\n", "block", "qd", "rings", "write GB/s", "read GB/s");
    }
    if (!opt.json) {
      std::printf("%8s %6d %6d %12.2f %12.2f\n", size_label(c.block_size_bytes).c_str(),
                  c.queue_depth, c.rings, measured.back().write_gbps, measured.back().read_gbps);
      if (do_both) {
        std::printf("%8s %6s %6s %12s %12s  both at once: %.2f GB/s (aggregate)\n", "", "", "", "", "",
                    measured.back().both_gbps);
      }
      std::fflush(stdout);
    }
  }

  if (opt.sweep) {
    // The best configuration serves both directions: highest harmonic mean of
    // write and read (or the one direction measured).
    auto score = [&](const Measured& m) {
      if (!do_write) return m.read_gbps;
      if (!do_read) return m.write_gbps;
      return m.write_gbps > 0 && m.read_gbps > 0 ? 2.0 / (1.0 / m.write_gbps + 1.0 / m.read_gbps)
                                                 : 0.0;
    };
    const Measured best = *std::max_element(
        measured.begin(), measured.end(),
        [&](const Measured& a, const Measured& b) { return score(a) < score(b); });
    const nlohmann::json aio = {{"aio",
                                 {{"block_size", best.config.block_size_bytes},
                                  {"queue_depth", best.config.queue_depth},
                                  {"intra_op_parallelism", best.config.rings},
                                  {"single_submit", opt.single_submit},
                                  {"overlap_events", opt.overlap_events}}}};
    if (opt.json) {
      std::printf("%s\n", nlohmann::json{{"best", aio["aio"]},
                                         {"write_gbps", best.write_gbps},
                                         {"read_gbps", best.read_gbps}}
                              .dump()
                              .c_str());
    } else {
      std::printf("\nbest: block %s, queue depth %d, %d ring(s): write %.2f GB/s, read %.2f GB/s\n",
                  size_label(best.config.block_size_bytes).c_str(), best.config.queue_depth,
                  best.config.rings, best.write_gbps, best.read_gbps);
      std::printf("%s\n", aio.dump(2).c_str());
    }
  }
  return kExitOk;
}

}  // namespace

void register_bench_io(CLI::App& app, int& result) {
  auto opt = std::make_shared<BenchIoOptions>();
  CLI::App* cmd = app.add_subcommand(
      "bench-io", "Measure NVMe write and read throughput of the I/O engine (GB/s = 1e9 B/s)");
  cmd->add_option("--dir", opt->dir, "Directory to benchmark (a temporary file is created there)");
  cmd->add_option("--file", opt->file,
                  "Benchmark this file instead (created if missing, kept afterwards)");
  cmd->add_option("--size-mb", opt->size_mb, "MiB written and then read per pass")
      ->capture_default_str();
  cmd->add_option("--block-size", opt->block_size, "Bytes per I/O: 256K, 1M, 4M, ...")
      ->capture_default_str();
  cmd->add_option("--queue-depth", opt->queue_depth, "I/Os in flight per ring")
      ->capture_default_str();
  cmd->add_option("--rings", opt->rings, "io_uring rings (worker threads)")->capture_default_str();
  cmd->add_flag("--sweep", opt->sweep,
                "Try block sizes {256K,1M,4M,8M} x queue depths {8,32,128} x rings {1,2,4}");
  cmd->add_flag("--json", opt->json, "Print one JSON object per measurement instead of a table");
  cmd->add_option("--backend", opt->backend, "auto | io_uring | threads")->capture_default_str();
  cmd->add_option("--direct", opt->direct, "O_DIRECT: auto | require | off")->capture_default_str();
  cmd->add_option("--ops", opt->ops,
                  "write,read | write | read; add both: read the written file while writing a second one "
                  "(the aggregate rate, run.rates.nvme_both_gbps)")
      ->capture_default_str();
  cmd->add_flag("--fsync", opt->fsync,
                "Time each write pass to the end of fdatasync (the durable rate a checkpoint pays)");
  cmd->add_option("--rounds", opt->rounds, "Passes per configuration (the table shows medians)")
      ->capture_default_str();
  cmd->add_option("--overlap-events", opt->overlap_events,
                  "Refill the queue as completions arrive (true) or per whole batch (false)")
      ->capture_default_str();
  cmd->add_flag("--single-submit", opt->single_submit, "One system call per I/O");
  cmd->add_option("--submit-batch", opt->submit_batch,
                  "Refill the queue once this many bytes completed (0: after every completion)")
      ->capture_default_str();
  cmd->callback([opt, &result]() {
    if (opt->dir.empty() == opt->file.empty()) {
      throw ConfigError("bench-io", "give exactly one of --dir DIR and --file PATH");
    }
    result = run_bench_io(*opt);
  });
}

}  // namespace strata
