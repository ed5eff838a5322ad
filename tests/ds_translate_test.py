"""tools/ds_translate.py (the DeepSpeed side-by-side's one translation of a Strata config) and the token order
tools/bench_deepspeed.py replays: no DeepSpeed needed. Run by CTest (tests/tools.cmake) as
`python3 tests/ds_translate_test.py STRATA_BINARY`; exits 77 (skipped) when transformers is missing, after
the cases that need no transformers ran."""
import copy
import json
import os
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import ds_translate as t  # noqa: E402
from bench_deepspeed import MT19937_64, window_starts  # noqa: E402

STRATA = None
try:
    import transformers  # noqa: F401
    HAVE_TRANSFORMERS = True
except ImportError:
    HAVE_TRANSFORMERS = False
BASE = {
    "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3, "gradient_clipping": 0.5,
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-7, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 50, "warmup_num_steps": 5,
                                                        "warmup_type": "linear", "cos_min_ratio": 0.1}},
    # Uneven on purpose: grouped-query attention, an automatic SwiGLU width that rounds (8 x 200 / 3 = 533
    # -> 544), an explicit head_dim, an untied head.
    "model": {"vocab_size": 300, "dim": 200, "n_layers": 3, "n_heads": 4, "n_kv_heads": 2, "head_dim": 40,
              "seq_len": 64, "tie_embeddings": False, "rope_theta": 500000, "norm_eps": 1e-6, "init_std": 0.01},
    "run": {"recompute": "always", "seed": 7},
}


class ModelTranslation(unittest.TestCase):
    def test_every_model_key_is_carried(self):
        h = t.hf_llama_config(BASE)
        self.assertEqual((h["vocab_size"], h["hidden_size"], h["num_hidden_layers"], h["num_attention_heads"],
                          h["num_key_value_heads"], h["head_dim"], h["max_position_embeddings"]),
                         (300, 200, 3, 4, 2, 40, 64))
        self.assertEqual(h["intermediate_size"], 544)  # int(8 x 200 / 3) = 533 rounded up to a multiple of 32
        self.assertEqual((h["rope_theta"], h["rms_norm_eps"], h["tie_word_embeddings"], h["initializer_range"]),
                         (500000.0, 1e-6, False, 0.01))
        self.assertEqual(t.hf_llama_config(BASE, layers=9)["num_hidden_layers"], 9)
        defaults = t.hf_llama_config({})  # Strata's model defaults (docs/config.md)
        self.assertEqual((defaults["hidden_size"], defaults["intermediate_size"], defaults["num_key_value_heads"],
                          defaults["head_dim"], defaults["tie_word_embeddings"]), (128, 352, 4, 32, True))

    @unittest.skipUnless(HAVE_TRANSFORMERS, "transformers (tools/setup.sh installs it into .venv)")
    def test_transformers_builds_the_model_strata_counts(self):
        """The translated LlamaConfig gives transformers' model exactly the parameters `strata plan` counts
        for the config (a mistranslated width, head count or tie changes one of the two)."""
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
        for cfg in (BASE, dict(BASE, model=dict(BASE["model"], tie_embeddings=True, n_kv_heads=0, head_dim=0,
                                                   ffn_hidden=300))):
            with torch.device("meta"):
                hf = LlamaForCausalLM(LlamaConfig(**t.hf_llama_config(cfg)))
            hf_count = sum(p.numel() for p in hf.parameters())
            self.assertEqual(t.parameters(cfg), hf_count)
            with tempfile.TemporaryDirectory() as d:
                path = os.path.join(d, "c.json")
                plan_cfg = copy.deepcopy(cfg)
                tokens = os.path.join(d, "tokens.u16")
                with open(tokens, "wb") as f:
                    f.write(bytes(2 * 4096))
                plan_cfg["data"] = {"path": tokens, "format": "uint16"}
                with open(path, "w") as f:
                    json.dump(plan_cfg, f)
                p = subprocess.run([STRATA, "plan", path, "--json", "--no-bound"], capture_output=True, text=True, timeout=120)
                self.assertEqual(p.returncode, 0, p.stderr)
                self.assertEqual(json.loads(p.stdout)["parameters"], hf_count)

    def test_refused_by_name(self):
        cases = [
            ("model.family", {"model": dict(BASE["model"], family="qwen2")}),
            ("model.rope_scaling", {"model": dict(BASE["model"], rope_scaling={"type": "linear", "factor": 2})}),
            ("model.sliding_window", {"model": dict(BASE["model"], sliding_window=32)}),
        ]
        for key, change in cases:
            with self.assertRaises(t.TranslationError) as e:
                t.hf_llama_config(dict(BASE, **change))
            self.assertEqual(e.exception.key, key)
        cases = [
            ("run.recompute", {"run": {"recompute": "auto"}}),
            ("run.recompute", {"run": {}}),  # Strata's default is auto
            ("run.optimizer_state_dtype", {"run": {"recompute": "always", "optimizer_state_dtype": "bf16"}}),
            ("fp16.enabled", {"bf16": {"enabled": False}, "fp16": {"enabled": True}}),
            ("optimizer.type", {"optimizer": {"type": "SGD"}}),
            ("train_batch_size", {"train_batch_size": 7}),
            ("placement", {}),
        ]
        for key, change in cases:
            with self.assertRaises(t.TranslationError) as e:
                t.ds_config(dict(BASE, **change), "everywhere" if key == "placement" else "nvme", "/swap")
            self.assertEqual(e.exception.key, key, change)


class DeepSpeedConfig(unittest.TestCase):
    def test_arithmetic_keys_carried(self):
        ds = t.ds_config(BASE, "nvme", "/swap", world_size=2)
        self.assertEqual((ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]), (2, 3))
        self.assertEqual(ds["gradient_clipping"], 0.5)
        self.assertEqual(ds["optimizer"], {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-7,
                                                                       "weight_decay": 0.1}})
        self.assertEqual(ds["scheduler"], BASE["scheduler"])
        self.assertEqual(ds["bf16"], {"enabled": True})
        self.assertNotIn("fp16", ds)
        self.assertNotIn("bf16", t.ds_config(dict(BASE, bf16={"enabled": False}), "cpu", "/swap"))  # fp32
        bare = dict(BASE, optimizer={"type": "Adam", "params": {"adam_w_mode": False}})
        del bare["gradient_clipping"]
        ds = t.ds_config(bare, "cpu", "/swap")  # Strata's defaults spelled out for DeepSpeed
        self.assertEqual(ds["optimizer"], {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                                                                      "weight_decay": 0.01, "adam_w_mode": False}})
        self.assertEqual(ds["gradient_clipping"], 1.0)

    def test_placements(self):
        want = {"nvme": ("nvme", "nvme"), "optimizer-nvme": ("nvme", "cpu"), "cpu": ("cpu", "cpu")}
        for placement, (opt, param) in want.items():
            z = t.ds_config(BASE, placement, "/swap")["zero_optimization"]
            self.assertEqual((z["stage"], z["offload_optimizer"]["device"], z["offload_param"]["device"]),
                             (3, opt, param))
            s = t.strata_config(BASE, placement, "/swap")["zero_optimization"]
            self.assertEqual((s["offload_optimizer"]["device"], s["offload_param"]["device"]), (opt, param))
        z = t.ds_config(BASE, "nvme", "/swap", tuning={"param_buffer_count": 5, "param_buffer_size": 10})
        p = z["zero_optimization"]["offload_param"]
        # max_in_cpu 0 (DeepSpeed's 1e9 keeps a small model in RAM); a buffer holds the largest tensor.
        self.assertEqual((p["max_in_cpu"], p["buffer_count"], p["buffer_size"], p["nvme_path"]), (0, 5, 300 * 200, "/swap"))
        self.assertEqual(t.strata_config(BASE, "nvme", "/swap")["zero_optimization"]["offload_param"]["max_in_cpu"], 0)


class TokenOrder(unittest.TestCase):
    def test_mt19937_64_is_the_standard_generator(self):
        g = MT19937_64(5489)  # the C++ standard's check: the 10000th value of a default-seeded mt19937_64
        for _ in range(9999):
            g()
        self.assertEqual(g(), 9981545732273789042)

    def test_windows_stay_in_the_training_part(self):
        starts = window_starts(MT19937_64(1), 1000, 0.1, 99, 500)
        self.assertLessEqual(max(starts) + 100, 900)
        self.assertEqual(min(starts) >= 0, True)
        self.assertGreater(max(starts), 700)  # the whole range is drawn


if __name__ == "__main__":
    STRATA = sys.argv.pop(1) if len(sys.argv) > 1 else os.path.join(ROOT, "build", "strata")
    result = unittest.main(exit=False).result
    # A skipped case (no transformers) is reported to CTest as skipped (77), never as passed.
    sys.exit(1 if result.failures or result.errors else 77 if result.skipped else 0)
