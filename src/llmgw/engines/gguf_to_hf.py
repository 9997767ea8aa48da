"""Convert a GGUF model into the Hugging Face layout vLLM loads (safetensors + config + tokenizer).

Run with the vLLM venv's Python (it needs torch, transformers and gguf, which vLLM brings):
    <vllm venv>/bin/python <llmgw>/engines/gguf_to_hf.py MODEL.gguf OUT_DIR

A script run by path, never imported by llmgw (whose venv has no torch): `engines/vllm_selftest.py` runs it.

`save_pretrained` refuses a model read from a quantized GGUF, so the state dict is written with safetensors
(bfloat16, the tied `lm_head` left out: the config's `tie_word_embeddings` makes it), the config without its
`quantization_config`, and the tokenizer as transformers rebuilt it from the GGUF. Written to OUT_DIR.tmp and
renamed, so a directory that exists is whole.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path


def main(gguf: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, torch_dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    state = {k: v.contiguous() for k, v in model.state_dict().items()
             if not (k == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False))}
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.torch_dtype = torch.bfloat16
    config.architectures = [type(model).__name__]  # vLLM picks its model class by this (else the bare LlamaModel)
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    print(f"converted {gguf.name} -> {out} ({sum(p.stat().st_size for p in out.iterdir()) >> 20} MiB)")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: gguf_to_hf.py MODEL.gguf OUT_DIR")
    main(Path(sys.argv[1]), Path(sys.argv[2]))
