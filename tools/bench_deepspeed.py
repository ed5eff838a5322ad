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
    """LlamaConfig keywords from a Strata config's "model" section (Strata's defaults for absent keys)."""
    m = cfg.get("model", {})
    dim, heads, mult = m.get("dim", 128), m.get("n_heads", 4), m.get("multiple_of", 32)
    ffn = m.get("ffn_hidden", 0) or (8 * dim // 3 + mult - 1) // mult * mult  # SwiGLU default, as Strata's
    return {"vocab_size": m.get("vocab_size", 256), "hidden_size": dim, "intermediate_size": ffn,
            "num_hidden_layers": layers or m.get("n_layers", 4), "num_attention_heads": heads,
            "num_key_value_heads": m.get("n_kv_heads", 0) or heads, "head_dim": dim // heads,
            "max_position_embeddings": m.get("seq_len", 128), "rope_theta": float(m.get("rope_theta", 10000.0)),
            "rms_norm_eps": m.get("norm_eps", 1e-5), "tie_word_embeddings": m.get("tie_embeddings", True),
            "attention_bias": False, "mlp_bias": False}


def make_ds_config(cfg, shape, args):
    """DeepSpeed's config: the Strata config's batch, clipping and optimizer; ZeRO-3 offloaded per --offload."""
    micro = cfg.get("train_micro_batch_size_per_gpu", 1)
    accum = cfg.get("gradient_accumulation_steps") or max(1, cfg.get("train_batch_size", micro) // micro)
    opt = cfg.get("optimizer", {})
    p = opt.get("params", {})
    opt_dev, param_dev = {"cpu": ("cpu", "cpu"), "nvme": ("nvme", "nvme"),
                          "optimizer-nvme": ("nvme", "cpu")}[args.offload]
    swap = os.path.join(os.path.abspath(args.nvme_path), "bench-ds")
    off_opt = {"device": opt_dev, "pin_memory": True}
    if opt_dev == "nvme":
        off_opt.update(nvme_path=swap, buffer_count=4, fast_init=False)
    off_param = {"device": param_dev, "pin_memory": True}
    if param_dev == "nvme":
        # A parameter being fetched takes one swap buffer, which must hold the largest one: the embedding
        # (and the untied head), vocab x hidden elements. Small ones (norms) stay on the GPU (persistence).
        largest = shape["vocab_size"] * shape["hidden_size"]
        off_param.update(nvme_path=swap, buffer_count=args.param_buffers, buffer_size=max(largest, 100_000_000))
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": cfg.get("gradient_clipping", 0.0),
        "steps_per_print": 1_000_000,
        "bf16": {"enabled": True},
        "optimizer": {"type": opt.get("type", "AdamW"),
                      "params": {"lr": p.get("lr", 1e-3), "betas": list(p.get("betas", [0.9, 0.999])),
                                 "eps": p.get("eps", 1e-8), "weight_decay": p.get("weight_decay", 0.01)}},
        # stage3_max_live_parameters, stage3_prefetch_bucket_size, persistence threshold: DeepSpeed's defaults.
        "zero_optimization": {"stage": 3, "offload_optimizer": off_opt, "offload_param": off_param,
                              "sub_group_size": 100_000_000, "overlap_comm": True, "contiguous_gradients": True},
        "aio": {"block_size": 1 << 20, "queue_depth": 32, "single_submit": False, "overlap_events": True},
    }


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
        from transformers import LlamaConfig, LlamaForCausalLM
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
        kw = dict(shape, use_cache=False)
        theta = kw.pop("rope_theta")
        try:
            hf = LlamaConfig(attn_implementation="sdpa", **kw)
        except Exception:  # a config class that takes no attn_implementation keyword
            hf = LlamaConfig(**kw)
            hf._attn_implementation = "sdpa"
        if hasattr(hf, "rope_parameters"):  # transformers 5: RoPE settings in one dict
            hf.rope_parameters = dict(hf.rope_parameters or {"rope_type": "default"}, rope_theta=theta)
        else:
            hf.rope_theta = theta
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
    ap.add_argument("--reentrant", action="store_true", help="reentrant gradient checkpointing")
    ap.add_argument("--install", action="store_true", help="install the carried DeepSpeed and libaio first")
    ap.add_argument("--check-carried", action="store_true",
                    help="install the carried set and check that it imports, loads its ops and builds nothing")
    ap.add_argument("--search", action="store_true", help="layer counts descending from --layers")
    ap.add_argument("--search-layers", help="the counts to try, e.g. 32,24,16,12,8,4")
    ap.add_argument("--timeout", type=float, default=540, help="seconds per attempt (child)")
    ap.add_argument("--budget", type=float, default=0, help="seconds for all attempts (0: no limit)")
    ap.add_argument("--out-dir", default="out/ds-bench")
    ap.add_argument("--json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--ds-config", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
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
