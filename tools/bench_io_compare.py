#!/usr/bin/env python3
"""Compare `strata bench-io` with fio (io_uring and libaio engines) and DeepSpeed's
async I/O handle on one directory, interleaved over several rounds.

Every engine writes and then reads the same preallocated file (same directory, same
size, same block size, queue depth and number of rings/jobs/threads), with O_DIRECT.
Before the first round one untimed pass writes the whole file, so every timed write
overwrites allocated blocks (the steady state of a swap file). The order of the
engines rotates from round to round. The report gives, per engine and direction,
the median GB/s (1e9 B/s), the average device request size seen in
/sys/dev/block/*/stat (how much the kernel merged), and the median over rounds of
Strata's per-round ratio to each engine and to the best other engine of that round.

  tools/bench_io_compare.py --strata build/strata --dir /path/on/nvme
  tools/bench_io_compare.py --strata build/strata --dir D --config sweep   # at the sweep's best

DeepSpeed runs when --deepspeed-python names a Python with deepspeed installed (its
async_io op is JIT-built on first use, needs libaio-dev, and takes minutes once).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import textwrap
import time

DS_WORKER = textwrap.dedent(
    r"""
    import json, sys, time, os
    import torch
    from deepspeed.ops.op_builder import AsyncIOBuilder
    aio = AsyncIOBuilder().load(verbose=False)
    path, size, bs, qd, threads, overlap = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \
        int(sys.argv[4]), int(sys.argv[5]), sys.argv[6] == "1"
    handle = aio.aio_handle(bs, qd, False, overlap, threads)
    buf = handle.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))
    buf.view(-1, 1 << 20)[:] = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        op = line.strip()
        if not op:
            continue
        t0 = time.perf_counter()
        n = handle.sync_pwrite(buf, path) if op == "write" else handle.sync_pread(buf, path)
        dt = time.perf_counter() - t0
        print(json.dumps({"op": op, "seconds": dt, "gbps": size / dt / 1e9, "ret": n}), flush=True)
    handle.free_cpu_locked_tensor(buf)
    """
)


def parse_size(text):
    text = str(text).strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * scale


def label(nbytes):
    return f"{nbytes >> 20}M" if nbytes % (1 << 20) == 0 else f"{nbytes >> 10}K"


def device_stat_path(directory):
    st = os.stat(directory)
    path = f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat"
    return path if os.path.exists(path) else None


def read_stat(path):
    if not path:
        return None
    f = [int(x) for x in open(path).read().split()]
    return {"read": (f[0], f[2]), "write": (f[4], f[6])}  # (requests, 512 B sectors)


def avg_request_kib(before, after, op):
    if not before or not after:
        return None
    reqs = after[op][0] - before[op][0]
    sectors = after[op][1] - before[op][1]
    return sectors * 512 / 1024 / reqs if reqs > 0 else None


def run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        sys.exit(f"command failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr[-2000:]}")
    return r.stdout


class Strata:
    def __init__(self, a, cfg, name="strata", extra=()):
        self.a, self.cfg, self.name, self.extra = a, cfg, name, list(extra)

    def measure(self, op):
        out = run([self.a.strata, "bench-io", "--file", self.a.file, "--size-mb", str(self.a.size_mb),
                   "--block-size", str(self.cfg["block_size"]), "--queue-depth", str(self.cfg["queue_depth"]),
                   "--rings", str(self.cfg["rings"]), "--ops", op, "--json", "--direct", "require"] + self.extra)
        rows = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
        return [r for r in rows if r.get("op") == op][0]["gbps"]


class Fio:
    def __init__(self, a, cfg, engine):
        self.a, self.cfg, self.engine = a, cfg, engine
        self.name = f"fio-{engine}"

    def measure(self, op):
        jobs = self.cfg["rings"]
        size = self.a.size_mb << 20
        cmd = ["fio", "--name=bench", f"--filename={self.a.file}", f"--ioengine={self.engine}",
               "--direct=1", f"--rw={op}", f"--bs={self.cfg['block_size']}",
               f"--iodepth={self.cfg['queue_depth']}", f"--size={size // jobs}",
               f"--numjobs={jobs}", f"--offset_increment={size // jobs}", "--group_reporting",
               "--output-format=json"]
        rep = json.loads(run(cmd))
        return rep["jobs"][0][op]["bw_bytes"] / 1e9


class DeepSpeed:
    def __init__(self, a, cfg, overlap):
        self.a, self.overlap = a, overlap
        self.name = "deepspeed" + ("-overlap" if overlap else "")
        args = [a.deepspeed_python, "-c", DS_WORKER, a.file, str(a.size_mb << 20), str(cfg["block_size"]),
                str(cfg["queue_depth"]), str(cfg["rings"]), "1" if overlap else "0"]
        env = dict(os.environ, DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"))
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self._read()  # ready

    def _read(self):
        while True:
            line = self.proc.stdout.readline()
            if not line:
                sys.exit(f"{self.name}: worker exited ({self.proc.wait()})")
            if line.startswith("{"):
                return json.loads(line)

    def measure(self, op):
        self.proc.stdin.write(op + "\n")
        self.proc.stdin.flush()
        r = self._read()
        if r.get("ret", 0) < 0:
            sys.exit(f"{self.name}: {op} failed ({r})")
        return r["gbps"]

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


def sweep_best(a):
    out = run([a.strata, "bench-io", "--file", a.file, "--size-mb", str(a.size_mb), "--sweep", "--json",
               "--direct", "require"])
    rows = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
    best = [r for r in rows if "best" in r][0]["best"]
    print(f"sweep best: block {label(best['block_size'])}, queue depth {best['queue_depth']}, "
          f"{best['intra_op_parallelism']} ring(s)")
    return {"block_size": best["block_size"], "queue_depth": best["queue_depth"],
            "rings": best["intra_op_parallelism"]}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strata", required=True, help="the strata binary (or one with bench-io)")
    p.add_argument("--dir", required=True, help="directory on the drive to measure")
    p.add_argument("--size-mb", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--config", default="fixed", choices=["fixed", "sweep"],
                   help="fixed: --block-size/--queue-depth/--rings; sweep: the best of `bench-io --sweep`")
    p.add_argument("--block-size", default="1M")
    p.add_argument("--queue-depth", type=int, default=32)
    p.add_argument("--rings", type=int, default=1)
    p.add_argument("--engines", default="strata,fio-io_uring,fio-libaio,deepspeed,deepspeed-overlap")
    p.add_argument("--deepspeed-python", default="", help="python with deepspeed (empty: skip it)")
    p.add_argument("--json-out", default="", help="also write every measurement here")
    a = p.parse_args()

    if not os.path.isdir(a.dir):
        sys.exit(f"{a.dir}: not a directory")
    need = (a.size_mb << 20) * 1.1
    if shutil.disk_usage(a.dir).free < need:
        sys.exit(f"{a.dir}: less than {need / 2**30:.1f} GiB free")
    a.file = os.path.join(a.dir, f"bench_io_compare.{os.getpid()}.dat")
    stat_path = device_stat_path(a.dir)
    try:
        # The untimed first pass lays out the file (and the sweep, if asked, reuses it).
        run([a.strata, "bench-io", "--file", a.file, "--size-mb", str(a.size_mb), "--ops", "write",
             "--json", "--direct", "require"])
        if a.config == "sweep":
            cfg = sweep_best(a)
        else:
            cfg = {"block_size": parse_size(a.block_size), "queue_depth": a.queue_depth, "rings": a.rings}
        wanted = a.engines.split(",")
        engines = []
        for name in wanted:
            if name == "strata":
                engines.append(Strata(a, cfg))
            elif name.startswith("strata-"):  # variants: strata-batch = --overlap-events false
                variant = {"strata-batch": ["--overlap-events", "false"],
                           "strata-eager": ["--submit-batch", "0"]}.get(name)
                if variant is None:
                    sys.exit(f"unknown engine {name}")
                engines.append(Strata(a, cfg, name, variant))
            elif name.startswith("fio-"):
                if shutil.which("fio"):
                    engines.append(Fio(a, cfg, name[4:]))
                else:
                    print(f"skipping {name}: fio not installed (tools/setup.sh installs it)")
            elif name.startswith("deepspeed"):
                if a.deepspeed_python:
                    engines.append(DeepSpeed(a, cfg, overlap=name.endswith("-overlap")))
                else:
                    print(f"skipping {name}: no --deepspeed-python")
        names = [e.name for e in engines]
        print(f"{time.strftime('%Y-%m-%d %H:%M:%S')}: {a.file}, {a.size_mb} MiB, block {label(cfg['block_size'])}, "
              f"queue depth {cfg['queue_depth']}, rings/jobs/threads {cfg['rings']}, {a.rounds} rounds; "
              f"engines: {', '.join(names)}")
        results = {n: {"write": [], "read": []} for n in names}
        reqs = {n: {"write": [], "read": []} for n in names}
        log = []
        for rnd in range(a.rounds):
            order = engines[rnd % len(engines):] + engines[:rnd % len(engines)]
            line = []
            for e in order:
                for op in ("write", "read"):
                    before = read_stat(stat_path)
                    gbps = e.measure(op)
                    kib = avg_request_kib(before, read_stat(stat_path), op)
                    results[e.name][op].append(gbps)
                    if kib:
                        reqs[e.name][op].append(kib)
                    log.append({"round": rnd, "engine": e.name, "op": op, "gbps": gbps, "avg_request_kib": kib,
                                **cfg, "size_mb": a.size_mb})
                    line.append(f"{e.name} {op[0]} {gbps:.2f}")
            print(f"round {rnd + 1}: " + ", ".join(line), flush=True)
        for e in engines:
            if isinstance(e, DeepSpeed):
                e.close()
    finally:
        if os.path.exists(a.file):
            os.unlink(a.file)

    print()
    print(f"{'engine':<20} {'write GB/s':>10} {'read GB/s':>10} {'w req KiB':>10} {'r req KiB':>10} "
          f"{'strata/x w':>11} {'strata/x r':>11}")
    summary = {}
    for n in names:
        row = {}
        for op in ("write", "read"):
            row[op] = statistics.median(results[n][op])
            row[op + "_req_kib"] = statistics.median(reqs[n][op]) if reqs[n][op] else float("nan")
            if "strata" in results and n != "strata":
                ratios = [s / o for s, o in zip(results["strata"][op], results[n][op])]
                row[op + "_ratio"] = statistics.median(ratios)
        summary[n] = row
        rw, rr = row.get("write_ratio"), row.get("read_ratio")
        print(f"{n:<20} {row['write']:>10.2f} {row['read']:>10.2f} {row['write_req_kib']:>10.0f} "
              f"{row['read_req_kib']:>10.0f} {'' if rw is None else f'{rw:.2f}x':>11} "
              f"{'' if rr is None else f'{rr:.2f}x':>11}")
    if "strata" in results and len(names) > 1:
        for op in ("write", "read"):
            others = [n for n in names if n != "strata"]
            per_round = [results["strata"][op][i] / max(results[n][op][i] for n in others)
                         for i in range(a.rounds)]
            best_median = max(others, key=lambda n: summary[n][op])
            target = summary["strata"][op] / summary[best_median][op]
            print(f"{op}: strata / best other engine, median of per-round ratios: "
                  f"{statistics.median(per_round):.2f}x; strata median / best median ({best_median}): "
                  f"{target:.2f}x")
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"config": cfg, "size_mb": a.size_mb, "rounds": a.rounds, "measurements": log,
                       "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
