"""A LoRA adapter for a GGUF base, written with the `gguf` package (issue 40's llama.cpp test).

llama.cpp reads an adapter GGUF as `convert_lora_to_gguf.py` writes one: `general.type = adapter`,
`adapter.type = lora`, `adapter.lora.alpha`, the base's `general.architecture`, and for each adapted weight
`W` (GGUF shape `[n_in, n_out]`) two tensors `<W>.lora_a` (`[n_in, r]`) and `<W>.lora_b` (`[r, n_out]`);
the applied delta is `scale * alpha / r * B @ A`. The weights here are seeded random and large, on every
layer's `ffn_down`, so that greedy decoding with the adapter visibly differs from the base's.
"""

from __future__ import annotations

from pathlib import Path


def write_lora_gguf(path: Path, base: Path, rank: int = 4, seed: int = 0, magnitude: float = 0.5) -> Path:
    """Write a rank-`rank` LoRA for the GGUF at `base` to `path`; returns `path`. Needs `gguf` and numpy."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(base)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(rank))
    rng = np.random.default_rng(seed)
    for t in reader.tensors:
        if not t.name.endswith("ffn_down.weight"):
            continue
        n_in, n_out = (int(x) for x in t.shape)  # GGUF order: ne0 (the input) first
        a = rng.normal(0, magnitude, size=(rank, n_in)).astype(np.float32)  # numpy order: [r][n_in]
        b = rng.normal(0, magnitude, size=(n_out, rank)).astype(np.float32)
        writer.add_tensor(t.name + ".lora_a", a)
        writer.add_tensor(t.name + ".lora_b", b)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
