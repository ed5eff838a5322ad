#!/usr/bin/env python3
"""GPU benchmark (d): DeepSpeed ZeRO-Infinity on the host Strata runs on, on the largest model it can start.

DeepSpeed (0.19.8, carried by tools/fetch_deepspeed.sh into .dev/deepspeed/) trains Hugging Face's
LlamaForCausalLM shaped as a Strata config's "model" section (--layers overrides n_layers), built under
deepspeed.zero.Init (ZeRO-3: never materialised whole) in bf16, SDPA attention, gradient checkpointing
(run.recompute "always"), on seeded random token ids. Its config (written to --out-dir) takes the Strata
config's micro batch and accumulation (the same global batch), clipping and AdamW (DeepSpeed's CPU Adam);
ZeRO-3 offloads per --offload: cpu (optimizer and parameters in pinned RAM), nvme (both on NVMe under
--nvme-path: ZeRO-Infinity, AIO 1 MiB blocks, queue depth 32) or optimizer-nvme (parameters in RAM).
Each attempt runs in a child python: --steps optimizer steps, each timed to torch.cuda.synchronize();
reported: the median tokens/s after --warmup steps, or where it failed (failed_at: install, init, model
construction, engine init, first step, step k) and how (the exception, the signal that killed the child
(OOM killer) or --timeout). "started": an optimizer step completed. --search tries layer counts descending
from --layers, a fresh child each, and stops at the first that trains all its steps.

--install unpacks the carried wheels offline into a fresh /tmp/ds-site (no pip needed): DeepSpeed's own
wheel has cpu_adam, async_io and pin_memory compiled (tools/fetch_deepspeed.sh builds it against torch
2.11.0 for Python 3.12, the host's), so nothing is JIT-built on the host (a JIT build would land in
/tmp/ds-ext: the report's "jit_built" lists what did); it unpacks the libaio .debs into /tmp/aio and points
LD_LIBRARY_PATH (and CPATH, LIBRARY_PATH, CFLAGS, LDFLAGS, should a build happen) there.
--check-carried installs the carried set and, with every compiler and ninja replaced by a stand-in that
fails, imports DeepSpeed and transformers, loads the ops, steps DeepSpeedCPUAdam and round-trips a file
through async_io, and checks nothing was built (tools/fetch_deepspeed.sh runs it here in a Python 3.12
environment holding torch and the GPU host image's other packages; part d of tools/gpu_proof.py runs attempts with the same install).

Usage (on the GPU host, from the repository root, carry [".dev"]):
  python3 tools/bench_deepspeed.py --install --strata-config configs/gpu-b-llama8b.json --offload nvme \\
      --layers 32 --steps 4 --json $OUT/ds-b.json                 # how DeepSpeed fares on the (b) model
  python3 tools/bench_deepspeed.py --install --strata-config configs/gpu-b-llama8b.json --offload nvme \\
      --search --layers 24 [--search-layers 24,16,12,8] [--budget 570] --json $OUT/ds-d.json
One JSON line is printed (and written to --json); logs, configs, child results go to --out-dir. Exit
status 0 when the reported attempt trained all its steps, 2 otherwise.
"""
import argparse
import glob
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ds_translate  # noqa: E402

SITE = "/tmp/ds-site"                   # DeepSpeed and the carried wheels (PYTHONPATH)
AIO = "/tmp/aio"                        # the libaio .debs, unpacked (never into /)
LIBDIR = AIO + "/usr/lib/x86_64-linux-gnu"
EXT = "/tmp/ds-ext"                     # TORCH_EXTENSIONS_DIR: JIT-built ops (none, with the carried wheel)
CARRIED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".dev", "deepspeed")
STOP = []                               # SIGTERM to the parent: stop the child, report what there is


def clip(text, n=40):
    """The first n lines of an error; a longer one (a compiler's output) keeps its head and the lines naming errors."""
    lines = [l for l in str(text).splitlines() if l.strip()]
    if len(lines) <= n:
        return "\n".join(lines)
    errs = [l for l in lines[5:] if re.search(r"error|fatal|undefined reference|Killed", l, re.I)]
    return "\n".join(lines[:5] + errs[:n - 5] if errs else lines[:n])


def link(src, dst):
    if not os.path.lexists(dst):
        os.symlink(src, dst)


def run_checked(cmd, env=None):
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:8])} ... failed ({p.returncode}):\n{p.stdout}{p.stderr}")


def strata_shape(cfg, layers):
    """LlamaConfig keywords for the model of a Strata config (tools/ds_translate.py)."""
    return ds_translate.hf_llama_config(cfg, layers)


def make_ds_config(cfg, shape, args):
    """The GPU path's DeepSpeed config (tools/ds_translate.py): ZeRO-3 offloaded per --offload, bf16, its
    parameter buffers (--param-buffers), 1e8-element sub-groups, AIO 1 MiB blocks at queue depth 32."""
    cfg = dict(cfg, bf16={"enabled": True}, fp16={"enabled": False},
               run=dict(cfg.get("run", {}), recompute="always"))
    swap = os.path.join(os.path.abspath(args.nvme_path), "bench-ds")
    tuning = {"param_buffer_count": args.param_buffers, "param_buffer_size": 100_000_000,
              "sub_group_size": 100_000_000,
              "aio": {"block_size": 1 << 20, "queue_depth": 32, "single_submit": False, "overlap_events": True}}
    return ds_translate.ds_config(cfg, args.offload, swap, device="cuda", tuning=tuning)


# ---- the host: offline install, libaio ---------------------------------------

def aio_lib_dirs():
    return sorted({os.path.dirname(p) for p in glob.glob(AIO + "/**/libaio.so*", recursive=True)})


def fix_libaio_links():
    """-laio needs libaio.so; libaio-dev's may point at an absolute path that dpkg -x relocated, or be absent."""
    for d in aio_lib_dirs():
        so = os.path.join(d, "libaio.so")
        if os.path.islink(so) and not os.path.exists(so):
            target = os.readlink(so)
            os.unlink(so)
            if os.path.isabs(target) and os.path.exists(AIO + target):
                os.symlink(AIO + target, so)
        versioned = sorted(glob.glob(os.path.join(d, "libaio.so.1*")))
        if not os.path.lexists(so) and versioned:
            os.symlink(os.path.basename(versioned[0]), so)


def ensure_libcuda():
    """async_io links -lcuda; a driver install may have only libcuda.so.1: an unversioned link in LIBDIR."""
    ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"
    try:
        cache = subprocess.run([ldconfig, "-p"], capture_output=True, text=True).stdout
    except OSError:
        return
    m = re.search(r"libcuda\.so\.1 .*=> (\S+)", cache)
    if m and not re.search(r"^\s*libcuda\.so ", cache, re.M):
        os.makedirs(LIBDIR, exist_ok=True)
        link(m.group(1), os.path.join(LIBDIR, "libcuda.so"))


def host_env(host):
    """The children's environment: DeepSpeed on PYTHONPATH, libaio for the compiler and the loader."""
    env = dict(os.environ, DS_ACCELERATOR="cuda", DS_BUILD_OPS="0", DS_SKIP_CUDA_CHECK="1",
               TORCH_EXTENSIONS_DIR=EXT)

    def prepend(key, paths, sep=":"):
        if paths:
            env[key] = sep.join(paths + ([env[key]] if env.get(key) else []))
    prepend("PYTHONPATH", [SITE] if os.path.isdir(SITE) else [])
    inc = [AIO + "/usr/include"] if os.path.isdir(AIO + "/usr/include") else []
    libs = sorted(set(aio_lib_dirs() + ([LIBDIR] if os.path.isdir(LIBDIR) else [])))
    prepend("CPATH", inc)
    prepend("LIBRARY_PATH", libs)
    prepend("LD_LIBRARY_PATH", libs)
    prepend("CFLAGS", [f"-I{d}" for d in inc], " ")   # what DeepSpeed's libaio probe (has_function) reads
    prepend("LDFLAGS", [f"-L{d}" for d in libs], " ")
    libaio = [p for d in libs for p in [os.path.join(d, "libaio.so")] if os.path.exists(p)]
    host.update(cxx=shutil.which("c++") or shutil.which("g++"), nvcc=shutil.which("nvcc"),
                libaio_carried=libaio[0] if libaio else None)
    return env


def unpack_wheel(path, site):
    """A wheel is a zip of its files as they lie in site-packages; its .data/purelib|platlib go there too
    (scripts and headers are not needed). No pip: the host's Python may have none."""
    import zipfile
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():
            parts = info.filename.split("/")
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue
                parts = parts[2:]
            dest = os.path.join(site, *parts)
            if info.is_dir():
                os.makedirs(dest, exist_ok=True)
                continue
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with z.open(info) as src, open(dest, "wb") as out:
                shutil.copyfileobj(src, out)
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                os.chmod(dest, mode)


def install(host):
    """Offline: the carried wheels (DeepSpeed's with its ops compiled, by tools/fetch_deepspeed.sh) unpacked
    into a fresh SITE (on the children's PYTHONPATH), the .debs unpacked into AIO (their own paths under it)."""
    wheels = sorted(glob.glob(CARRIED + "/whl/*.whl"))
    if not any(os.path.basename(w).startswith("deepspeed-") for w in wheels):
        raise RuntimeError(f"no DeepSpeed wheel in {CARRIED}/whl: run tools/fetch_deepspeed.sh, carry .dev")
    shutil.rmtree(SITE, ignore_errors=True)
    os.makedirs(SITE)
    os.makedirs(AIO, exist_ok=True)
    for deb in sorted(glob.glob(CARRIED + "/deb/*.deb")):
        run_checked(["dpkg", "-x", deb, AIO])
    fix_libaio_links()
    ensure_libcuda()
    for w in wheels:
        unpack_wheel(w, SITE)
    host["installed"] = [os.path.basename(p) for p in wheels]


def jit_built():
    """What DeepSpeed JIT-compiled into TORCH_EXTENSIONS_DIR (nothing, with the carried prebuilt ops)."""
    found = []
    for d, _, files in os.walk(EXT):
        found += [os.path.relpath(os.path.join(d, f), EXT) for f in files if f.endswith(".so")]
    return sorted(found)


CHECK = r"""
import json, os, sys, tempfile, time
t0 = time.time()
import torch, deepspeed, transformers
from transformers import LlamaConfig, LlamaForCausalLM
from deepspeed.ops.op_builder import CPUAdamBuilder, AsyncIOBuilder
from deepspeed.ops.adam import DeepSpeedCPUAdam
out = {"python": sys.version.split()[0], "torch": torch.__version__, "deepspeed": deepspeed.__version__,
       "transformers": transformers.__version__, "deepspeed_file": deepspeed.__file__}
cpu_adam = CPUAdamBuilder().load()
aio = AsyncIOBuilder().load()
out["ops"] = {"cpu_adam": cpu_adam.__file__, "async_io": aio.__file__}
w = torch.nn.Parameter(torch.ones(4096))
opt = DeepSpeedCPUAdam([w], lr=0.1)
w.grad = torch.ones(4096)
opt.step()
out["cpu_adam_step_ok"] = bool(torch.all(w < 1).item())
h = aio.aio_handle(1 << 20, 8, False, True, 1)
x = torch.arange(1 << 18, dtype=torch.float32)
y = torch.zeros_like(x)
with tempfile.TemporaryDirectory() as d:
    f = os.path.join(d, "x.bin")
    h.sync_pwrite(x, f)
    h.sync_pread(y, f)
out["async_io_roundtrip_ok"] = bool(torch.equal(x, y))
m = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1))
out["llama_parameters"] = sum(p.numel() for p in m.parameters())
out["seconds"] = time.time() - t0
print(json.dumps(out))
"""


def check_carried(args):
    """Installs the carried set and, in a child whose compilers and ninja are stand-ins that fail (and
    say so), imports DeepSpeed and transformers, loads cpu_adam and async_io, steps DeepSpeedCPUAdam and
    round-trips a file through async_io; then checks that nothing was JIT-built."""
    host, report = {}, {"check": "carried"}
    try:
        install(host)
        if not os.path.exists("/dev/nvidiactl"):  # no driver here: async_io's libcuda.so.1 is the toolkit's stub
            stub = "/usr/local/cuda/lib64/stubs/libcuda.so"
            if os.path.exists(stub):
                os.makedirs(LIBDIR, exist_ok=True)
                link(stub, os.path.join(LIBDIR, "libcuda.so.1"))
                report["libcuda"] = "the CUDA toolkit's stub (no driver on this machine)"
        env = host_env(host)
        stubs = os.path.join(AIO, "no-compilers")
        os.makedirs(stubs, exist_ok=True)
        for tool in ("c++", "g++", "gcc", "cc", "nvcc", "ninja"):
            with open(os.path.join(stubs, tool), "w") as f:
                f.write(f'#!/bin/sh\necho "{tool} called: a JIT build" >&2\nexit 1\n')
            os.chmod(os.path.join(stubs, tool), 0o755)
        env["PATH"] = stubs + ":" + env.get("PATH", "")
        shutil.rmtree(EXT, ignore_errors=True)
        p = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=600)
        report.update(host=host, rc=p.returncode)
        lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
        if lines:
            report.update(json.loads(lines[-1]))
        if p.returncode != 0:
            report["error"] = clip(p.stderr)
        report["jit_built"] = jit_built()
        report["ok"] = (p.returncode == 0 and not report["jit_built"] and report.get("cpu_adam_step_ok") is True
                        and report.get("async_io_roundtrip_ok") is True
                        and all(o.startswith(SITE) for o in report.get("ops", {}).values()))
    except Exception as e:
        report.update(ok=False, error=clip(e))
    line = json.dumps(report)
    if args.json:
        with open(args.json, "w") as f:
            f.write(line + "\n")
    print(line, flush=True)
    print("carried DeepSpeed: " + ("imports, loads its prebuilt ops from " + SITE + " and builds nothing"
                                   if report["ok"] else "NOT usable as carried (see the line above)"), flush=True)
    sys.exit(0 if report["ok"] else 2)


def llama_config(shape):
    """transformers' LlamaConfig (MixtralConfig for model_type mixtral) from ds_translate's keywords (SDPA
    attention, no KV cache)."""
    from transformers import LlamaConfig, MixtralConfig
    kw = dict(shape, use_cache=False)
    theta = kw.pop("rope_theta")
    cls = MixtralConfig if kw.pop("model_type", "llama") == "mixtral" else LlamaConfig
    try:
        hf = cls(attn_implementation="sdpa", **kw)
    except Exception:  # a config class that takes no attn_implementation keyword
        hf = cls(**kw)
        hf._attn_implementation = "sdpa"
    if hasattr(hf, "rope_parameters"):  # transformers 5: RoPE settings in one dict
        hf.rope_parameters = dict(hf.rope_parameters or {"rope_type": "default"}, rope_theta=theta)
    else:
        hf.rope_theta = theta
    return hf


# ---- one attempt, in a child process -------------------------------------------------------------------------

def child(args):
    """Trains in this process; its progress (stage, step times) is rewritten to args.result as it goes."""
    res = {"stage": "init", "step_s": []}

    def save(stage=None):
        if stage:
            res["stage"] = stage
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            res["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
            res["peak_gpu_reserved_bytes"] = torch.cuda.max_memory_reserved()
        with open(args.result + ".tmp", "w") as f:
            json.dump(res, f)
        os.replace(args.result + ".tmp", args.result)
        print(f"[bench_deepspeed] {res['stage'] or 'done'}", flush=True)

    ok = False
    try:
        save()
        import torch
        import deepspeed
        import transformers
        from transformers import LlamaForCausalLM
        res["versions"] = {"deepspeed": deepspeed.__version__, "torch": torch.__version__,
                           "transformers": transformers.__version__}
        with open(args.strata_config) as f:
            shape = strata_shape(json.load(f), args.layers)
        with open(args.ds_config) as f:
            ds = json.load(f)
        with socket.socket() as s:  # single process, no launcher: the env:// rendezvous on a free port
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.cuda.set_device(0)
        deepspeed.init_distributed(dist_backend="nccl")

        save("model construction")
        hf = llama_config(shape)
        with deepspeed.zero.Init(config_dict_or_path=ds, dtype=torch.bfloat16):
            model = LlamaForCausalLM(hf)  # each module partitioned (and offloaded) as it is built
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": args.reentrant})
        res["parameters"] = sum(getattr(p, "ds_numel", None) or p.numel() for p in model.parameters())
        res["attn_implementation"] = getattr(model.config, "_attn_implementation", None)

        save("engine init")  # builds cpu_adam (and async_io), allocates the offloaded optimizer state
        engine, *_ = deepspeed.initialize(model=model, config=ds,
                                          model_parameters=[p for p in model.parameters() if p.requires_grad])
        engine.train()
        micro, accum = ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]
        gen = torch.Generator().manual_seed(args.seed)
        for step in range(args.steps):
            save("first step" if step == 0 else f"step {step + 1}")
            batches = [torch.randint(0, shape["vocab_size"], (micro, shape["max_position_embeddings"]),
                                     generator=gen) for _ in range(accum)]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for ids in batches:
                ids = ids.to(engine.device, non_blocking=True)
                loss = engine(input_ids=ids, labels=ids).loss  # the model shifts the labels
                engine.backward(loss)
                engine.step()  # the optimizer steps at the accumulation boundary only
            torch.cuda.synchronize()
            res["step_s"].append(time.perf_counter() - t0)
            res["loss"] = loss.item()
            print(f"[bench_deepspeed] step {step + 1}: {res['step_s'][-1]:.2f} s, loss {res['loss']:.4f}", flush=True)
        res["stage"] = None
        ok = True
    except BaseException as e:  # OOM, config errors, op builds, ...: reported, not raised
        traceback.print_exc()
        res["error"] = clip("".join(traceback.format_exception_only(type(e), e)))
        res["where"] = [f"{fr.filename}:{fr.lineno} in {fr.name}" for fr in traceback.extract_tb(e.__traceback__)[-4:]]
    save()
    sys.stdout.flush()
    os._exit(0 if ok else 1)  # no teardown (NCCL, AIO threads) to hang on


def die_with_parent():
    try:
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: no orphan holding the GPU
    except Exception:
        pass


def attempt(args, cfg, layers, env, limit):
    """Runs one child; survives it being killed (the OOM killer) and kills it at the time limit."""
    shape = strata_shape(cfg, layers)
    ds = make_ds_config(cfg, shape, args)
    tag = f"{args.offload}-L{layers}"
    ds_path, result, log = (os.path.join(args.out_dir, n) for n in
                            (f"ds_config-{tag}.json", f"result-{tag}.json", f"ds-{tag}.log"))
    with open(ds_path, "w") as f:
        json.dump(ds, f, indent=1)
    if os.path.exists(result):
        os.remove(result)
    swap = os.path.join(os.path.abspath(args.nvme_path), "bench-ds")
    shutil.rmtree(swap, ignore_errors=True)  # what an earlier attempt left
    os.makedirs(swap, exist_ok=True)
    free = shutil.disk_usage(swap).free
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--result", result, "--ds-config", ds_path,
           "--strata-config", args.strata_config, "--layers", str(layers), "--steps", str(args.steps),
           "--seed", str(args.seed)] + (["--reentrant"] if args.reentrant else [])
    t0, why = time.monotonic(), None
    with open(log, "w") as lf:
        proc = subprocess.Popen(cmd, env=env, stdout=lf, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=die_with_parent)
        while True:  # wait4: the child's peak RSS, even when it was killed
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if STOP or time.monotonic() - t0 > limit:
                why = "interrupted (SIGTERM)" if STOP else f"timed out after {limit:.0f} s"
                os.killpg(proc.pid, signal.SIGKILL)  # the child and the compilers it started
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.5)
    code = proc.returncode = os.waitstatus_to_exitcode(status)
    shutil.rmtree(swap, ignore_errors=True)
    r = {"stage": "init"}
    if os.path.exists(result):
        with open(result) as f:
            r = json.load(f)
    steps = r.get("step_s", [])
    tokens = ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * shape["max_position_embeddings"]
    rates = [tokens / s for s in (steps[args.warmup:] or steps)]
    ok = code == 0 and why is None and len(steps) >= args.steps
    if ok:
        error = None
    elif why or code < 0:
        error = why or f"killed by {signal.Signals(-code).name}" + \
            (" (the kernel's OOM killer, most likely)" if code == -signal.SIGKILL else "")
    else:
        error = r.get("error") or f"exit status {code}"
    out = {"layers": layers, "parameters": r.get("parameters"), "offload": args.offload, "global_batch_tokens": tokens,
           "tokens_per_s": statistics.median(rates) if rates else None, "step_s": steps, "started": bool(steps),
           "ok": ok, "failed_at": None if ok else r.get("stage") or "exit", "error": error, "where": r.get("where"),
           "peak_gpu_bytes": r.get("peak_gpu_bytes"), "peak_gpu_reserved_bytes": r.get("peak_gpu_reserved_bytes"),
           "peak_host_rss_bytes": usage.ru_maxrss * 1024, "nvme_free_bytes": free, "exit": code,
           "seconds": time.monotonic() - t0, "loss": r.get("loss"), "attn_implementation": r.get("attn_implementation"),
           "versions": r.get("versions"), "log": log, "ds_config_path": ds_path, "ds_config": ds}
    if not ok:
        with open(log, errors="replace") as f:
            out["log_tail"] = clip("\n".join(f.read().splitlines()[-40:]))
    return out


# ---- on this machine's CPU: both engines side by side (--device cpu) ---------------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DS_CPU = os.path.join(ROOT, ".deps", "deepspeed-cpu")  # tools/setup_deepspeed.sh: venv, ext (built ops), build.json
M64 = (1 << 64) - 1
# DeepSpeed's knobs for the CPU comparison (tools/ds_translate.py ds_config's tuning; BENCHMARKS.md, "Strata
# against DeepSpeed on the CPU", says what was tried): the best that trained the 185 M model on the dev VM.
# Its defaults fail there: 5 (and 16) parameter buffers run out ("Not enough buffers 0 for swapping 1": the
# first step keeps every fetched parameter while stage3_max_reuse_distance is 1e9), and NVMe parameter
# prefetch trips "param already assigned swap buffer"; the pipelined optimizer swapper over 2e7-element
# sub-groups with 16 buffers was 11% faster than 4 buffers and one sub-group; the aio settings changed nothing.
DS_CPU_TUNING = {"param_buffer_count": 32, "max_reuse_distance": 0, "max_live_parameters": 30_000_000,
                 "prefetch_bucket_size": 0, "optimizer_buffer_count": 16, "optimizer_pipeline": True,
                 "sub_group_size": 20_000_000}


class MT19937_64:
    """std::mt19937_64, the generator Strata draws its batch windows with (src/data/dataset.cc): the same seed
    gives DeepSpeed the same windows in the same order."""

    def __init__(self, seed):
        self.mt = [seed & M64]
        for i in range(1, 312):
            prev = self.mt[-1]
            self.mt.append((6364136223846793005 * (prev ^ (prev >> 62)) + i) & M64)
        self.index = 312

    def _twist(self):
        mt = self.mt
        for i in range(312):
            x = (mt[i] & 0xFFFFFFFF80000000) | (mt[(i + 1) % 312] & 0x7FFFFFFF)
            mt[i] = mt[(i + 156) % 312] ^ (x >> 1) ^ (0xB5026F5AA96619E9 if x & 1 else 0)
        self.index = 0

    def __call__(self):
        if self.index >= 312:
            self._twist()
        y = self.mt[self.index]
        self.index += 1
        y ^= (y >> 29) & 0x5555555555555555
        y ^= (y << 17) & 0x71D67FFFEDA60000
        y ^= (y << 37) & 0xFFF7EEE000000000
        y ^= y >> 43
        return y & M64


def window_starts(rng, num_tokens, val_fraction, seq_len, rows):
    """Start offsets of one step's `rows` windows (seq_len + 1 tokens each) in the training part, as
    TokenDataset::sample_train draws them."""
    train_end = num_tokens - int(float(num_tokens) * val_fraction)
    choices = train_end - (seq_len + 1) + 1
    return [rng() % choices for _ in range(rows)]


def read_json(path):
    with open(path) as f:
        return json.load(f)


def cpu_child(args):
    """DeepSpeed trains in this process on the CPU accelerator: the model of the comparison config, its
    initial weights (--init-dir, Hugging Face safetensors) loaded into the ZeRO-3 partitions, Strata's windows
    of its token file in Strata's order; each optimizer step's mean loss (over micro-batches and ranks), lr
    and own seconds are rewritten to --result as they come (the parent polls it)."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    res = {"stage": "init", "step_s": [], "loss": [], "lr": [], "grad_norm": [], "rank": rank}

    def save(stage=None):
        res["stage"] = stage
        if rank == 0:
            with open(args.result + ".tmp", "w") as f:
                json.dump(res, f)
            os.replace(args.result + ".tmp", args.result)

    ok = False
    try:
        save("init")
        import numpy as np
        import torch
        import torch.nn.functional as F
        torch.set_num_threads(args.threads)
        import deepspeed
        import transformers
        from transformers import LlamaForCausalLM
        res["versions"] = {"deepspeed": deepspeed.__version__, "torch": torch.__version__,
                           "transformers": transformers.__version__}
        cfg = read_json(args.strata_config)
        ds = read_json(args.ds_config)
        shape = ds_translate.hf_llama_config(cfg, args.layers)
        deepspeed.init_distributed(dist_backend="gloo")

        save("model construction")
        dtype = torch.bfloat16 if ds.get("bf16", {}).get("enabled") else torch.float32
        with deepspeed.zero.Init(config_dict_or_path=ds, dtype=dtype):
            # each module partitioned (and offloaded) as built
            model = transformers.AutoModelForCausalLM.from_config(llama_config(shape))
        moe = shape.get("model_type") == "mixtral"
        if moe:
            # DeepSpeed's documented way for MoE blocks under ZeRO-3 (PR #4966): the sparse block is one
            # leaf, its experts gathered whole, so ranks routing differently do not hang on fetch order.
            from deepspeed.utils import set_z3_leaf_modules
            from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
            set_z3_leaf_modules(model, [MixtralSparseMoeBlock])
        if args.init_dir:  # the same initial weights as Strata's (model.init_from): into the partitions
            from safetensors import safe_open
            with safe_open(os.path.join(args.init_dir, "model.safetensors"), "pt") as f:
                names = set(f.keys())
                for name, p in model.named_parameters():
                    if name not in names:
                        raise RuntimeError(f"{args.init_dir}: no tensor {name}")
                    with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                        if rank == 0:
                            p.data.copy_(f.get_tensor(name).to(p.dtype))
        if cfg.get("run", {}).get("recompute") == "always":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": args.reentrant})
            if args.lora_dir:  # the frozen embedding's output must carry a gradient for checkpointed layers
                model.enable_input_require_grads()
        res["parameters"] = sum(getattr(p, "ds_numel", None) or p.numel() for p in model.parameters())
        if args.lora_dir:
            # LoRA mode: Hugging Face PEFT over the partitioned (offloaded) base, from the same initial
            # adapter as Strata's lora.init_from; ZeRO-3 partitions the adapters at initialize.
            from peft import PeftModel
            save("peft")
            model = PeftModel.from_pretrained(model, args.lora_dir, is_trainable=True)
            res["trainable_parameters"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
            res["versions"]["peft"] = __import__("peft").__version__

        save("engine init")
        engine, *_ = deepspeed.initialize(model=model, config=ds,
                                          model_parameters=[p for p in model.parameters() if p.requires_grad])
        engine.train()
        # DeepSpeed's schedulers start at iteration -1, whose rate is 0: its first optimizer step does
        # nothing, and step s applies the schedule's rate of iteration s - 2. Strata's step s applies that
        # of iteration s - 1 (docs/config.md, "scheduler"). One step of the scheduler before training puts
        # DeepSpeed on Strata's rates (the report's "lr" shows both).
        sched = engine.lr_scheduler
        if sched is not None and getattr(sched, "last_batch_iteration", None) == -1:
            sched.step(0)
        micro, accum = ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]
        seq = shape["max_position_embeddings"]
        data = cfg["data"]
        tokens = np.memmap(data["path"] if isinstance(data["path"], str) else data["path"][0],
                           dtype={"uint16": np.uint16, "uint32": np.uint32}[data["format"]], mode="r")
        rng = MT19937_64(int(cfg.get("run", {}).get("seed", 1234)))
        rows = micro * accum * world
        vocab = shape["vocab_size"]
        for step in range(args.steps):
            save("first step" if step == 0 else f"step {step + 1}")
            starts = window_starts(rng, len(tokens), data.get("val_fraction", 0.1), seq, rows)
            mine = starts[rank * micro * accum:(rank + 1) * micro * accum]  # rank r's rows, as Strata's
            lr = engine.get_lr()[0]  # the rate this step applies (Strata's metrics say the same)
            t0 = time.perf_counter()
            losses = []
            for m in range(accum):
                win = torch.from_numpy(np.stack([tokens[s:s + seq + 1].astype(np.int64)
                                                 for s in mine[m * micro:(m + 1) * micro]]))
                out = engine(input_ids=win[:, :seq], **({"output_router_logits": True} if moe else {}))
                loss = F.cross_entropy(out.logits.float().reshape(-1, vocab), win[:, 1:].reshape(-1))
                if moe and shape.get("output_router_logits"):  # the load-balancing loss, as Strata's
                    engine.backward(loss + shape["router_aux_loss_coef"] * out.aux_loss)
                else:
                    engine.backward(loss)
                engine.step()  # the optimizer steps at the accumulation boundary only
                losses.append(loss.detach().float())
            mean = torch.stack(losses).mean()
            if world > 1:
                torch.distributed.all_reduce(mean)
                mean /= world
            res["step_s"].append(time.perf_counter() - t0)
            res["loss"].append(mean.item())
            res["lr"].append(lr)
            gn = engine.get_global_grad_norm()
            res["grad_norm"].append(float(gn) if gn is not None else None)
        ok = True
    except BaseException as e:  # reported, not raised
        traceback.print_exc()
        res["error"] = clip("".join(traceback.format_exception_only(type(e), e)))
        res["where"] = [f"{fr.filename}:{fr.lineno} in {fr.name}" for fr in traceback.extract_tb(e.__traceback__)[-4:]]
    save(None if ok else res["stage"])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if ok else 1)  # no teardown (gloo, AIO threads) to hang on


def proc_io(pid):
    """(read_bytes, write_bytes) of /proc/PID/io: bytes the process (all its threads) made the block layer
    read and write, O_DIRECT included; None when gone."""
    try:
        with open(f"/proc/{pid}/io") as f:
            kv = dict(line.split(": ") for line in f.read().splitlines())
        return int(kv["read_bytes"]), int(kv["write_bytes"])
    except (OSError, KeyError, ValueError):
        return None


def proc_mem(pid):
    """(VmHWM, VmLck) in bytes from /proc/PID/status: peak resident and locked memory; None when gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            kv = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
        return int(kv["VmHWM"].split()[0]) * 1024, int(kv["VmLck"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def steps_done(kind, progress):
    """Optimizer steps an engine reports done: lines of Strata's metrics file, DeepSpeed's result file."""
    try:
        if kind == "strata":
            with open(progress) as f:
                return sum(1 for line in f if line.startswith('{"') and '"step"' in line and '"loss"' in line)
        return len(read_json(progress).get("step_s", []))
    except (OSError, ValueError):
        return 0


def run_engine(kind, cmds, envs, progress, log, limit):
    """Starts one process per rank, polls every 20 ms: the wall time at which rank 0's progress shows each
    step's end, the ranks' /proc/PID/io at that moment, their peak RSS and locked memory; kills them all at
    `limit` seconds. Returns the figures, the same way for both engines."""
    t0 = time.monotonic()
    procs, logs = [], []
    for r, (cmd, env) in enumerate(zip(cmds, envs)):
        lf = open(log if r == 0 else f"{log}.rank{r}", "w")
        logs.append(lf)
        procs.append(subprocess.Popen(cmd, env=env, stdout=lf, stderr=subprocess.STDOUT, start_new_session=True,
                                      preexec_fn=die_with_parent))
    ends, io_at, peak_rss, peak_lck, last_io = [], [], [0] * len(procs), [0] * len(procs), [None] * len(procs)
    why = None
    while True:
        alive = [p.poll() is None for p in procs]
        for i, p in enumerate(procs):
            io = proc_io(p.pid)
            if io:
                last_io[i] = io
            mem = proc_mem(p.pid)
            if mem:
                peak_rss[i], peak_lck[i] = max(peak_rss[i], mem[0]), max(peak_lck[i], mem[1])
        n = steps_done(kind, progress)
        while len(ends) < n:
            ends.append(time.monotonic() - t0)
            io_at.append([list(x) if x else None for x in last_io])
        if not any(alive):
            break
        if STOP or time.monotonic() - t0 > limit:
            why = "interrupted (SIGTERM)" if STOP else f"timed out after {limit:.0f} s"
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            break
        time.sleep(0.02)
    codes = [p.wait() for p in procs]
    for lf in logs:
        lf.close()
    return {"step_end_s": ends, "io_at_step_end": io_at, "exit": codes, "why": why,
            "peak_rss_bytes": peak_rss, "peak_locked_bytes": peak_lck, "seconds": time.monotonic() - t0}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_envs(world, threads, extra=None):
    port = free_port()
    base = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), **(extra or {}))
    return [dict(base, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)) for r in range(world)]


def summarise(kind, run, losses, lrs, tokens_per_step, warmup, own_step_s):
    """Tokens/s from the step ends the parent saw (median after `warmup` steps), start-up = command to the
    first step's end, NVMe bytes per step (sum over ranks, mean over the steps after warm-up)."""
    ends = run["step_end_s"]
    gaps = [b - a for a, b in zip(ends, ends[1:])][max(0, warmup - 1):]
    out = {"engine": kind, "steps": len(ends), "startup_s": ends[0] if ends else None,
           "tokens_per_s": tokens_per_step / statistics.median(gaps) if gaps else None,
           "step_s": [round(g, 3) for g in gaps], "own_step_s": own_step_s, "loss": losses, "lr": lrs,
           "peak_rss_bytes": max(run["peak_rss_bytes"]), "peak_rss_bytes_sum": sum(run["peak_rss_bytes"]),
           "peak_locked_bytes": max(run["peak_locked_bytes"]), "exit": run["exit"], "error": run["why"],
           "seconds": run["seconds"]}
    io = run["io_at_step_end"]
    if len(io) > warmup and all(x is not None for x in io[warmup - 1 if warmup else 0]) and all(x is not None for x in io[-1]):
        first = io[warmup - 1] if warmup else io[0]
        n = len(io) - 1 - (warmup - 1 if warmup else 0)
        if n > 0:
            out["nvme_read_bytes_per_step"] = sum(b[0] - a[0] for a, b in zip(first, io[-1])) / n
            out["nvme_write_bytes_per_step"] = sum(b[1] - a[1] for a, b in zip(first, io[-1])) / n
    return out


def make_tokens(path, vocab, count):
    """A uint16 token file of real text: the bytes of the licence texts Debian ships (ids < 256 within a
    larger vocabulary), repeated to `count` tokens. Written once."""
    if os.path.exists(path) and os.path.getsize(path) == 2 * count:
        return
    text = b""
    for f in sorted(glob.glob("/usr/share/common-licenses/*")):
        if os.path.isfile(f):
            with open(f, "rb") as fh:
                text += fh.read()
    if not text:
        raise RuntimeError("no text under /usr/share/common-licenses for the token file")
    import array
    ids = array.array("H", list((text * (count // len(text) + 1))[:count]))
    assert max(ids) < vocab
    with open(path + ".tmp", "wb") as f:
        ids.tofile(f)
    os.replace(path + ".tmp", path)


def make_init_weights(cfg, out_dir, seed):
    """Hugging Face safetensors + config.json of a freshly initialised LlamaForCausalLM (MixtralForCausalLM) of the config's model,
    in bf16: both engines start from them (Strata: model.init_from; DeepSpeed: loaded into its partitions)."""
    if os.path.exists(os.path.join(out_dir, "model.safetensors")):
        return
    import torch
    import transformers
    torch.manual_seed(seed)
    shape = ds_translate.hf_llama_config(cfg)
    model = transformers.AutoModelForCausalLM.from_config(llama_config(shape))
    tmp = out_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    # An MoE model in transformers 5's fused layout: its file names are the model's parameter names, which
    # the DeepSpeed child loads by; Strata reads either layout.
    extra = {"save_original_format": False} if shape.get("model_type") == "mixtral" else {}
    model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True, **extra)
    os.replace(tmp, out_dir)


def make_init_adapter(cfg, base_dir, out_dir, seed):
    """LoRA mode: a PEFT adapter (adapter_model.safetensors + adapter_config.json) of the config's `lora`
    section over the base at base_dir, initialised by PEFT (A kaiming-uniform, B zeros) from `seed`: both
    engines start from it (Strata: lora.init_from; DeepSpeed: PeftModel.from_pretrained)."""
    if os.path.exists(os.path.join(out_dir, "adapter_model.safetensors")):
        return
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM
    lora = dict(cfg["lora"])
    model = LlamaForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, LoraConfig(
        r=lora.get("r", 8), lora_alpha=lora.get("lora_alpha", 8), lora_dropout=lora.get("lora_dropout", 0.0),
        target_modules=lora["target_modules"], use_rslora=lora.get("use_rslora", False), task_type="CAUSAL_LM"))
    tmp = out_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    peft_model.save_pretrained(tmp)
    os.replace(tmp, out_dir)


def ds_env(threads, world):
    return rank_envs(world, threads, {"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": os.path.join(DS_CPU, "ext"),
                                      "PYTHONUNBUFFERED": "1"})


def check_cpu_setup(args):
    py = os.path.join(DS_CPU, "venv", "bin", "python")
    if not os.path.exists(py) or not os.path.exists(os.path.join(DS_CPU, "build.json")):
        raise SystemExit("bench_deepspeed.py --device cpu: no DeepSpeed in .deps/deepspeed-cpu: run "
                         "tools/setup_deepspeed.sh first")
    if not os.access(args.strata, os.X_OK):
        raise SystemExit(f"bench_deepspeed.py: no strata binary at {args.strata} (tools/setup.sh builds it)")
    return py


def run_deepspeed_cpu(args, cfg_path, cfg, placement, world, tag, layers=0, tuning=None, init_dir=None, lora_dir=None):
    threads = max(1, (os.cpu_count() or 2) // world)
    swap = os.path.join(os.path.abspath(args.nvme_path), "ds")
    shutil.rmtree(swap, ignore_errors=True)
    os.makedirs(swap)
    ds = ds_translate.ds_config(cfg, placement, swap, world, "cpu", tuning if tuning is not None else args.tuning)
    ds_path = os.path.join(args.out_dir, f"ds-{tag}.json")
    with open(ds_path, "w") as f:
        json.dump(ds, f, indent=1)
    result = os.path.join(args.out_dir, f"ds-{tag}.result.json")
    if os.path.exists(result):
        os.remove(result)
    cmd = [args.ds_python, os.path.abspath(__file__), "--device", "cpu", "--child", "--result", result,
           "--ds-config", ds_path, "--strata-config", cfg_path, "--steps", str(args.steps),
           "--threads", str(threads), "--layers", str(layers)] + (["--init-dir", init_dir] if init_dir else []) + \
        (["--lora-dir", lora_dir] if lora_dir else []) + \
        ["--reentrant" if args.reentrant else "--no-reentrant"]
    ops = lambda: set(glob.glob(os.path.join(DS_CPU, "ext", "*", "*.so")))  # noqa: E731
    before = ops()
    run = run_engine("deepspeed", [cmd] * world, ds_env(threads, world), result,
                     os.path.join(args.out_dir, f"ds-{tag}.log"), args.timeout)
    built = sorted(os.path.basename(p) for p in ops() - before)
    if built:  # a JIT build inside this run's start-up: tools/setup_deepspeed.sh should have made it
        print(f"  WARNING: DeepSpeed built {built} during this run: its start-up includes the build", flush=True)
    shutil.rmtree(swap, ignore_errors=True)
    r = read_json(result) if os.path.exists(result) else {}
    micro, accum = ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]
    tokens = micro * accum * world * ds_translate.hf_llama_config(cfg)["max_position_embeddings"]
    out = summarise("deepspeed", run, r.get("loss", []), r.get("lr", []), tokens, args.warmup, r.get("step_s"))
    out.update(parameters=r.get("parameters"), grad_norm=r.get("grad_norm"), ds_config=ds, jit_built=built,
               failed_at=r.get("stage"), log=os.path.join(args.out_dir, f"ds-{tag}.log"))
    if r.get("error") or not out["steps"]:
        out["error"] = out["error"] or r.get("error") or f"exit {run['exit']}"
    return out


def strata_run_config(args, cfg, placement, world, tag, layers=0, init_dir=None, lora_dir=None):
    swap = os.path.join(os.path.abspath(args.nvme_path), "strata")
    shutil.rmtree(swap, ignore_errors=True)
    os.makedirs(swap)
    sc = ds_translate.strata_config(cfg, placement, swap)
    sc["model"] = dict(sc.get("model", {}))
    if layers:
        sc["model"]["n_layers"] = layers
    if init_dir:
        sc["model"]["init_from"] = os.path.abspath(init_dir)
    if lora_dir:  # LoRA mode: the same initial adapter as DeepSpeed's PEFT (its adapter_config.json fills the keys)
        sc["lora"] = {"init_from": os.path.abspath(lora_dir)}
    metrics = os.path.join(args.out_dir, f"strata-{tag}.metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    sc["run"] = dict(sc.get("run", {}), steps=args.steps, metrics=metrics,
                     threads=max(1, (os.cpu_count() or 2) // world))
    path = os.path.join(args.out_dir, f"strata-{tag}.json")
    with open(path, "w") as f:
        json.dump(sc, f, indent=1)
    return path, metrics, swap


def run_strata_cpu(args, cfg, placement, world, tag, layers=0, init_dir=None, lora_dir=None):
    path, metrics, swap = strata_run_config(args, cfg, placement, world, tag, layers, init_dir, lora_dir)
    threads = max(1, (os.cpu_count() or 2) // world)
    run = run_engine("strata", [[args.strata, "train", path]] * world, rank_envs(world, threads), metrics,
                     os.path.join(args.out_dir, f"strata-{tag}.log"), args.timeout)
    shutil.rmtree(swap, ignore_errors=True)
    lines = []
    if os.path.exists(metrics):
        with open(metrics) as f:
            for l in f:
                try:  # a line cut short by a kill at the time limit is not one
                    lines.append(json.loads(l))
                except ValueError:
                    pass
    steps = [l for l in lines if "loss" in l and "step" in l]
    micro, accum = ds_translate.batch(cfg, world)
    tokens = micro * accum * world * ds_translate.hf_llama_config(cfg)["max_position_embeddings"]
    out = summarise("strata", run, [l["loss"] for l in steps], [l["lr"] for l in steps], tokens, args.warmup,
                    [l["step_s"] for l in steps])
    out.update(grad_norm=[l.get("grad_norm") for l in steps], log=os.path.join(args.out_dir, f"strata-{tag}.log"),
               strata_nvme_read_bytes=[l.get("nvme_read_bytes") for l in steps],
               strata_nvme_write_bytes=[l.get("nvme_write_bytes") for l in steps],
               bound_s=[l.get("bound_s") for l in steps])
    if not out["steps"] or any(run["exit"]):
        with open(out["log"], errors="replace") as f:
            out["error"] = out["error"] or clip("\n".join(f.read().splitlines()[-15:]))
    return out


PLACEMENT_NAMES = {"1": ("nvme", 1), "2": ("optimizer-nvme", 1), "3": ("cpu", 1), "4": ("nvme", 2)}


def loss_agreement(a, b):
    """The largest relative difference of two engines' per-step losses."""
    pairs = list(zip(a or [], b or []))
    return max((abs(x - y) / max(abs(y), 1e-12) for x, y in pairs), default=None)


def prepare_cpu(args, name):
    """The comparison's config with the token file both engines read (written once under --out-dir), refused
    by key when it does not translate; written to --out-dir/NAME. Returns (config, its path)."""
    args.ds_python = check_cpu_setup(args)
    os.makedirs(args.out_dir, exist_ok=True)
    cfg = read_json(args.strata_config)
    ds_translate.check_run(cfg)
    shape = ds_translate.hf_llama_config(cfg)
    tokens_path = os.path.abspath(os.path.join(args.out_dir, "tokens.u16"))
    make_tokens(tokens_path, shape["vocab_size"], max(1 << 21, 64 * (shape["max_position_embeddings"] + 1)))
    cfg["data"] = {"path": tokens_path, "format": "uint16", "val_fraction": 0.0, "eval_interval": 0}
    path = os.path.join(args.out_dir, name)
    with open(path, "w") as f:
        json.dump(cfg, f, indent=1)
    return cfg, path


def compare_cpu(args):
    """--device cpu: for each placement, --rounds rounds with both engines, the order alternating; medians and
    same-round ratios (Strata's tokens/s / DeepSpeed's)."""
    cfg, cmp_path = prepare_cpu(args, "compare-config.json")
    init_dir = os.path.abspath(os.path.join(args.out_dir, "init-weights"))
    make_init_weights(cfg, init_dir, int(cfg.get("run", {}).get("seed", 1234)))
    lora_dir = None
    if "lora" in cfg:  # LoRA mode (the config's lora section): PEFT on DeepSpeed against Strata's LoRA
        lora_dir = os.path.abspath(os.path.join(args.out_dir, "init-adapter"))
        make_init_adapter(cfg, init_dir, lora_dir, int(cfg.get("run", {}).get("seed", 1234)))
    build = read_json(os.path.join(DS_CPU, "build.json"))
    report = {"device": "cpu", "config": args.strata_config, "lora": "lora" in cfg, "rounds": args.rounds, "steps": args.steps,
              "warmup": args.warmup, "deepspeed_ops_build": build, "tuning": args.tuning, "placements": {}}
    for key in args.placements.split(","):
        placement, world = PLACEMENT_NAMES[key]
        rounds = []
        for r in range(args.rounds):
            if STOP:
                break
            order = ["deepspeed", "strata"] if r % 2 == 0 else ["strata", "deepspeed"]
            got = {"strata": {"loss": []}, "deepspeed": {"loss": []}}
            for eng in [e for e in order if e in args.engines.split(",")]:
                tag = f"p{key}-r{r}"
                print(f"[bench_deepspeed] placement ({key}) {placement} x{world}, round {r + 1}: {eng}", flush=True)
                if eng == "deepspeed":
                    got[eng] = run_deepspeed_cpu(args, cmp_path, cfg, placement, world, tag, init_dir=init_dir,
                                                 lora_dir=lora_dir)
                else:
                    got[eng] = run_strata_cpu(args, cfg, placement, world, tag, init_dir=init_dir, lora_dir=lora_dir)
                g = got[eng]
                print(f"  {eng}: " + (f"{g['tokens_per_s']:.1f} tokens/s, start-up {g['startup_s']:.1f} s, "
                                      f"losses {[round(x, 4) for x in g['loss']]}" if g.get("tokens_per_s")
                                      else f"failed: {g.get('error')}"), flush=True)
            a, b = got["strata"].get("tokens_per_s"), got["deepspeed"].get("tokens_per_s")
            got["ratio"] = a / b if a and b else None
            got["loss_rel_diff"] = loss_agreement(got["strata"]["loss"], got["deepspeed"]["loss"])
            rounds.append(got)
        med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
        summary = {"placement": placement, "world_size": world, "rounds": rounds,
                   "ratio_median": med([g["ratio"] for g in rounds if g["ratio"]])}
        for eng in ("strata", "deepspeed"):
            rs = [g[eng] for g in rounds]
            summary[eng] = {k: med([x[k] for x in rs if x.get(k) is not None]) for k in
                            ("tokens_per_s", "startup_s", "peak_rss_bytes", "peak_locked_bytes",
                             "nvme_read_bytes_per_step", "nvme_write_bytes_per_step")}
        summary["startup_ratio_median"] = med([g["deepspeed"]["startup_s"] / g["strata"]["startup_s"] for g in rounds
                                               if g["deepspeed"].get("startup_s") and g["strata"].get("startup_s")])
        summary["loss_rel_diff_max"] = max((g["loss_rel_diff"] for g in rounds if g["loss_rel_diff"] is not None),
                                           default=None)
        report["placements"][key] = summary
        print(f"[bench_deepspeed] ({key}) {placement} x{world}: Strata / DeepSpeed tokens/s {summary['ratio_median']}, "
              f"start-up DeepSpeed / Strata {summary['startup_ratio_median']}, losses within "
              f"{summary['loss_rel_diff_max']}", flush=True)
        write_report(args, report)
    return report


def write_report(args, report):
    line = json.dumps(report)
    if args.json:
        with open(args.json + ".tmp", "w") as f:
            f.write(line + "\n")
        os.replace(args.json + ".tmp", args.json)


def search_largest_cpu(args):
    """--search-largest: each engine's largest layer count (of the config's model) that trains --steps steps
    with ZeRO-Infinity's placement (1), by doubling then bisecting, one fresh process per attempt."""
    cfg, cmp_path = prepare_cpu(args, "search-config.json")
    report = {"device": "cpu", "search": True, "config": args.strata_config, "tuning": args.tuning, "engines": {}}
    for eng in args.engines.split(","):
        tried = {}

        def trains(layers):
            if STOP:
                return False
            if layers not in tried:
                tag = f"search-{eng}-L{layers}"
                print(f"[bench_deepspeed] {eng}: {layers} layers", flush=True)
                r = (run_deepspeed_cpu(args, cmp_path, cfg, "nvme", 1, tag, layers=layers) if eng == "deepspeed"
                     else run_strata_cpu(args, dict(cfg, model=dict(cfg["model"], n_layers=layers)), "nvme", 1, tag))
                r["layers"] = layers
                tried[layers] = r
                print(f"  {'trained' if r['steps'] >= args.steps else 'failed'}: {r['steps']} steps, "
                      f"{r.get('tokens_per_s')} tokens/s, peak RSS {r['peak_rss_bytes'] / 2**30:.1f} GiB"
                      + ("" if r["steps"] >= args.steps else f", {str(r.get('error')).splitlines()[:1]}"), flush=True)
            return tried[layers]["steps"] >= args.steps
        lo = 0
        if args.search_layers:  # the given counts, largest first, until one trains
            for n in sorted({int(x) for x in args.search_layers.split(",")}, reverse=True):
                if trains(n):
                    lo = n
                    break
        else:
            hi = args.search_from
            while trains(hi):  # double until one fails
                lo, hi = hi, hi * 2
            while hi - lo > max(1, lo // 8):  # bisect to within an eighth
                mid = (lo + hi) // 2
                if trains(mid):
                    lo = mid
                else:
                    hi = mid
        best = tried.get(lo)
        report["engines"][eng] = {"largest_layers": lo, "largest_parameters": ds_translate.parameters(cfg, lo) if lo else None,
                                  "attempts": [{k: v for k, v in t.items() if k not in ("ds_config",)}
                                               for t in tried.values()]}
        write_report(args, report)
    return report


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strata-config", default="configs/gpu-b-llama8b.json")
    ap.add_argument("--layers", type=int, default=0, help="n_layers override (0: the config's)")
    ap.add_argument("--offload", choices=["cpu", "nvme", "optimizer-nvme"], default="nvme")
    ap.add_argument("--nvme-path", default="out/ds-swap", help="DeepSpeed's swap files go to NVME_PATH/bench-ds")
    ap.add_argument("--param-buffers", type=int, default=8, help="offload_param.buffer_count (nvme)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--reentrant", action=argparse.BooleanOptionalAction, default=None,
                    help="reentrant gradient checkpointing (default: on with --device cpu, where DeepSpeed's ZeRO-3 "
                         "with parameters on NVMe at one rank computes wrong gradients under the non-reentrant "
                         "kind: BENCHMARKS.md; off with cuda)")
    ap.add_argument("--install", action="store_true", help="install the carried DeepSpeed and libaio first")
    ap.add_argument("--check-carried", action="store_true",
                    help="install the carried set and check that it imports, loads its ops and builds nothing")
    ap.add_argument("--search", action="store_true", help="layer counts descending from --layers")
    ap.add_argument("--search-layers", help="the counts to try, e.g. 32,24,16,12,8,4 (largest first; the first that trains "
                    "is the engine's largest)")
    ap.add_argument("--timeout", type=float, default=540, help="seconds per attempt (child)")
    ap.add_argument("--budget", type=float, default=0, help="seconds for all attempts (0: no limit)")
    ap.add_argument("--out-dir", default="out/ds-bench")
    ap.add_argument("--json")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: both engines side by side on this machine's CPU (tools/setup_deepspeed.sh first)")
    ap.add_argument("--strata", default="build/strata", help="(cpu) the strata binary")
    ap.add_argument("--placements", default="1,2,3,4",
                    help="(cpu) 1 ZeRO-Infinity (all on NVMe), 2 optimizer on NVMe, 3 all in RAM, 4 = 1 on two ranks")
    ap.add_argument("--rounds", type=int, default=3, help="(cpu) rounds per placement, engines alternating")
    ap.add_argument("--tuning", type=json.loads, default=DS_CPU_TUNING,
                    help="(cpu) DeepSpeed's knobs as JSON (tools/ds_translate.py ds_config's tuning keys)")
    ap.add_argument("--search-largest", action="store_true",
                    help="(cpu) each engine's largest layer count with placement 1, doubling from --search-from")
    ap.add_argument("--search-from", type=int, default=8)
    ap.add_argument("--engines", default="strata,deepspeed", help="(cpu) the engines run (e.g. deepspeed alone to tune it)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--ds-config", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--init-dir", help=argparse.SUPPRESS)
    ap.add_argument("--lora-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.reentrant is None:
        args.reentrant = args.device == "cpu" and not args.child
    if args.child:
        return cpu_child(args) if args.device == "cpu" else child(args)
    if args.device == "cpu":
        signal.signal(signal.SIGTERM, lambda *_: STOP.append(1))
        report = search_largest_cpu(args) if args.search_largest else compare_cpu(args)
        print(json.dumps(report), flush=True)
        return
    if args.check_carried:
        return check_carried(args)

    signal.signal(signal.SIGTERM, lambda *_: STOP.append(1))
    deadline = time.monotonic() + args.budget if args.budget else float("inf")
    os.makedirs(args.out_dir, exist_ok=True)
    with open(args.strata_config) as f:
        cfg = json.load(f)
    top = args.layers or cfg.get("model", {}).get("n_layers", 4)
    if args.search_layers:
        counts = [int(x) for x in args.search_layers.split(",")]
    elif args.search:
        counts = [top] + [n for n in (24, 16, 12, 8, 4, 2, 1) if n < top]
    else:
        counts = [top]
    host, attempts = {}, []
    try:
        if args.install:
            install(host)
        env = host_env(host)
    except Exception as e:
        attempts.append({"layers": top, "offload": args.offload, "started": False, "ok": False,
                         "failed_at": "install", "error": clip(e), "step_s": []})
        counts = []
    for n in counts:
        left = min(args.timeout, deadline - time.monotonic())
        if left < min(30, args.timeout) or STOP:  # not worth starting
            break
        a = attempt(args, cfg, n, env, left)
        attempts.append(a)
        print(f"layers {n}: " + (f"{a['tokens_per_s']:.0f} tokens/s, steps {[round(s, 2) for s in a['step_s']]}"
                                 if a["ok"] else f"failed at {a['failed_at']}: {(a['error'] or '').splitlines()[:1]}"),
              flush=True)
        if a["ok"] or not (args.search or args.search_layers):
            break
    if not attempts:
        attempts.append({"layers": top, "offload": args.offload, "started": False, "ok": False,
                         "failed_at": "init", "error": "no time left for an attempt", "step_s": []})
    final = next((a for a in attempts if a.get("ok")), attempts[-1])
    report = {k: None for k in ("layers", "parameters", "offload", "global_batch_tokens", "tokens_per_s",
                                 "step_s", "started", "failed_at", "error", "peak_gpu_bytes",
                                 "peak_host_rss_bytes", "ds_config")}
    report.update(final, host=host, jit_built=jit_built())
    if len(attempts) > 1:  # the search: every attempt, without its (repeated) DeepSpeed config
        report["attempts"] = [{k: v for k, v in a.items() if k not in ("ds_config", "log_tail")} for a in attempts]
    line = json.dumps(report)
    if args.json:
        with open(args.json, "w") as f:
            f.write(line + "\n")
    print(line, flush=True)
    sys.exit(0 if final.get("ok") else 2)


if __name__ == "__main__":
    main()
