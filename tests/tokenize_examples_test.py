"""tools/tokenize.py on fine-tuning examples (docs/token-format.md, "Examples
and loss masks"), against transformers' apply_chat_template.

Per family, a byte-level BPE trained here with the family's special tokens and
a chat template written in that family's format (Llama 3's headers, Mistral's
[INST], Qwen2's ChatML, Qwen3's ChatML with an empty think block in assistant
turns). A conversation (system, user, assistant, user, assistant) goes
through tokenize.py: its ids must be apply_chat_template(tokenize=True)'s, and
the tokens its mask counts, decoded, must be what the template puts in the
assistant turns after the generation prompt through the end-of-turn token,
written out by hand below. Then prompt + completion (TRL's rule), the index
file, and bad input: one line naming file and line, exit 2, nothing written.

usage: tokenize_examples_test.py   (exit 77: transformers missing)
"""
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
TOOL = os.path.join(HERE, "..", "tools", "tokenize.py")

try:
    import numpy as np
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer
except ImportError as e:
    print(f"skipped: {e}")
    sys.exit(77)

SPECIAL = ["<|endoftext|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
           "<|im_start|>", "<|im_end|>", "<s>", "</s>", "[INST]", "[/INST]"]

CHATML = ("{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + {think} m['content'] + '<|im_end|>\\n' }}"
          "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
QWEN3_THINK = "('<think>\\n\\n</think>\\n\\n' if m['role'] == 'assistant' else '') +"

FAMILIES = {
    "llama": {
        "bos": "<|begin_of_text|>", "eos": "<|eot_id|>",
        "template": ("{{- bos_token }}{%- for m in messages %}{{- '<|start_header_id|>' + m['role'] + "
                     "'<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
                     "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
                     "{%- endif %}"),
        "counted": ["It is four.<|eot_id|>", "How are you today?<|eot_id|>"],
    },
    "mistral": {
        "bos": "<s>", "eos": "</s>",
        "template": ("{{- bos_token }}{%- set sys = messages[0]['content'] + '\\n\\n' if messages[0]['role'] == "
                     "'system' else '' %}{%- for m in messages %}{%- if m['role'] == 'user' %}"
                     "{{- '[INST] ' + (sys if loop.index0 <= 1 else '') + m['content'] + ' [/INST]' }}"
                     "{%- elif m['role'] == 'assistant' %}{{- ' ' + m['content'] + eos_token }}{%- endif %}"
                     "{%- endfor %}"),
        "counted": [" It is four.</s>", " How are you today?</s>"],
    },
    "qwen2": {
        "bos": None, "eos": "<|im_end|>",
        "template": CHATML.replace("{think}", ""),
        "counted": ["It is four.<|im_end|>", "How are you today?<|im_end|>"],
    },
    "qwen3": {
        "bos": None, "eos": "<|im_end|>",
        "template": CHATML.replace("{think}", QWEN3_THINK),
        "counted": ["<think>\n\n</think>\n\nIt is four.<|im_end|>", "<think>\n\n</think>\n\nHow are you today?<|im_end|>"],
    },
}

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "It is four."},
    {"role": "user", "content": "Hello there"},
    {"role": "assistant", "content": "How are you today?"},
]

failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print(f"FAILED: {what}")


def make_tokenizer(root, family):
    corpus = os.path.join(root, "corpus.txt")
    with open(corpus, "w") as f:
        f.write(("The quick brown fox jumps over the lazy dog. What is two plus two? It is four. "
                 "You are a helpful assistant. Hello there, how are you today? Q: 2+2? A: 4.\n") * 50)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train([corpus], trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL,
                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    d = os.path.join(root, family)
    os.makedirs(d)
    tok.save(os.path.join(d, "tokenizer.json"))
    spec = FAMILIES[family]
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": spec["eos"], "chat_template": spec["template"]}
    if spec["bos"]:
        cfg["bos_token"] = spec["bos"]
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f)
    return d


def run(tokenizer, out, *inputs):
    return subprocess.run([sys.executable, TOOL, "--tokenizer", tokenizer, "--out", out, "--no-progress", *inputs],
                          capture_output=True, text=True)


def read(out):
    side = json.load(open(out + ".json"))
    ids = np.fromfile(out, dtype=np.uint16 if side["dtype"] == "uint16" else np.uint32).tolist()
    mask = np.fromfile(out + ".mask", dtype=np.uint8).tolist()
    idx = np.fromfile(out + ".idx", dtype="<u8").tolist()
    return side, ids, mask, idx


def spans(ids, mask):
    """The runs of counted ids."""
    out, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            out.append(cur)
            cur = []
    if cur:
        out.append(cur)
    return out


def ids_of(hf, msgs, **kw):
    r = hf.apply_chat_template(msgs, tokenize=True, **kw)
    return list(r["input_ids"] if hasattr(r, "keys") else r)


def test_family(root, family):
    d = make_tokenizer(root, family)
    hf = AutoTokenizer.from_pretrained(d)
    data = os.path.join(root, family + ".jsonl")
    second = [CONVERSATION[1], CONVERSATION[2]]
    with open(data, "w") as f:
        f.write(json.dumps({"messages": CONVERSATION}) + "\n\n")
        f.write(json.dumps({"messages": second}) + "\n")
    out = os.path.join(root, family + ".bin")
    r = run(d, out, data)
    check(r.returncode == 0, f"{family}: tokenize.py failed: {r.stderr}")
    if r.returncode != 0:
        return
    side, ids, mask, idx = read(out)
    want = ids_of(hf, CONVERSATION)
    want2 = ids_of(hf, second)
    check(ids == want + want2, f"{family}: ids differ from apply_chat_template's")
    check(idx == [0, len(want), len(want) + len(want2)], f"{family}: index {idx}")
    check(len(mask) == len(ids), f"{family}: mask of {len(mask)} bytes for {len(ids)} tokens")
    got = [hf.decode(s, skip_special_tokens=False) for s in spans(ids[:len(want)], mask[:len(want)])]
    check(got == FAMILIES[family]["counted"], f"{family}: counted spans {got!r}")
    got2 = [hf.decode(s, skip_special_tokens=False) for s in spans(ids[len(want):], mask[len(want):])]
    check(got2 == FAMILIES[family]["counted"][:1], f"{family}: second example's counted spans {got2!r}")
    check(side.get("version") == 2 and side.get("examples") == 2 and side.get("counted") == sum(mask)
          and side.get("mask") == family + ".bin.mask" and side.get("index") == family + ".bin.idx",
          f"{family}: sidecar {side}")
    check(side.get("eos_id") == hf.convert_tokens_to_ids(FAMILIES[family]["eos"]), f"{family}: eos_id")


def test_prompt_completion(root):
    d = os.path.join(root, "qwen2")
    hf = AutoTokenizer.from_pretrained(d)
    data = os.path.join(root, "pc.jsonl")
    rows = [{"prompt": "Q: 2+2?", "completion": " A: 4."}, {"prompt": "Hello there,", "completion": " how are you?"}]
    with open(data, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    out = os.path.join(root, "pc.bin")
    r = run(d, out, data)
    check(r.returncode == 0, f"prompt/completion: {r.stderr}")
    if r.returncode != 0:
        return
    side, ids, mask, idx = read(out)
    eos = hf.convert_tokens_to_ids("<|im_end|>")
    want, at, want_idx = [], 0, [0]
    for row in rows:
        e = hf(row["prompt"] + row["completion"])["input_ids"] + [eos]
        want += e
        want_idx.append(len(want))
    check(ids == want, "prompt/completion: ids")
    check(idx == want_idx, f"prompt/completion: index {idx}")
    got = [hf.decode(s, skip_special_tokens=False) for s in spans(ids, mask)]
    check(got == [" A: 4.<|im_end|>", " how are you?<|im_end|>"], f"prompt/completion: counted {got!r}")
    check(side.get("kind") == "prompt_completion", "prompt/completion: kind")


def test_bad_input(root):
    d = os.path.join(root, "llama")
    cases = [
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "x"}]}, "has role 'wizard'"),
        ({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]}, "no assistant turn"),
        ({"text": "no messages here"}, "no 'messages' list"),
    ]
    for i, (row, words) in enumerate(cases):
        data = os.path.join(root, f"bad{i}.jsonl")
        with open(data, "w") as f:
            f.write(json.dumps({"messages": CONVERSATION}) + "\n")
            f.write(json.dumps(row) + "\n")
        out = os.path.join(root, f"bad{i}.bin")
        r = run(d, out, data)
        lines = r.stderr.strip().splitlines()
        check(r.returncode == 2, f"bad input {i}: exit {r.returncode}")
        check(len(lines) == 1 and f"{data}:2:" in lines[0] and words in lines[0], f"bad input {i}: {r.stderr!r}")
        left = [n for n in os.listdir(root) if n.startswith(f"bad{i}.bin")]
        check(left == [], f"bad input {i}: left behind {left}")


def main():
    with tempfile.TemporaryDirectory() as root:
        for family in FAMILIES:
            test_family(root, family)
        test_prompt_completion(root)
        test_bad_input(root)
    if failures:
        print(f"{len(failures)} failure(s)")
        sys.exit(1)
    print("tokenize examples: all checks passed")


if __name__ == "__main__":
    main()
