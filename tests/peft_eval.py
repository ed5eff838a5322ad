"""A Strata LoRA export loaded by PEFT, the check of tests/lora_train_test.cc.

Usage: peft_eval.py BASE_DIR ADAPTER_DIR TOKENS_BIN SEQUENCES WIDTH
(ADAPTER_DIR "none": BASE_DIR alone, e.g. a merged export.)
Loads the base with transformers and the adapter with PeftModel.from_pretrained,
reloads the adapter's tensors with set_peft_model_state_dict to count missing
(adapter keys of the model the file lacks) and unexpected keys, and prints one
JSON line: the mean cross-entropy over TOKENS_BIN's sequences (int64 [SEQUENCES,
WIDTH]: inputs [:, :-1], targets [:, 1:]) with the adapter applied, in fp32,
eval mode, and the key counts.
"""
import json
import sys

import numpy as np
import torch
import transformers
from peft import PeftModel
from peft.utils import load_peft_weights, set_peft_model_state_dict


def main():
    base_dir, adapter_dir, tokens_bin, n, width = sys.argv[1:6]
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32,
                                                             attn_implementation="sdpa")
    if adapter_dir == "none":
        model, weights, missing, unexpected = base, {}, [], []
    else:
        model = PeftModel.from_pretrained(base, adapter_dir)
        weights = load_peft_weights(adapter_dir)
        unexpected = list(set_peft_model_state_dict(model, weights).unexpected_keys)
        lora_keys = {k for k in model.state_dict() if "lora_" in k}
        loaded = {k.replace(".weight", ".default.weight") for k in weights}
        missing = sorted(lora_keys - loaded)
    model.eval()
    tokens = torch.from_numpy(np.fromfile(tokens_bin, dtype="<i8").reshape(int(n), int(width)).copy())
    with torch.no_grad():
        logits = model(input_ids=tokens[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))
    print(json.dumps({"loss": loss.item(), "missing": missing, "unexpected": unexpected,
                      "adapter_tensors": len(weights)}))


if __name__ == "__main__":
    main()
