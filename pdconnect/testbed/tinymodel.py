"""Generate tiny local models with real random weights for running real vLLM engines on CPU.

No model is ever downloaded: every checkpoint here is built from a config and a seeded
random initialisation, so two runs with the same spec give byte-identical weights. The
weights are real (not vLLM's `load_format="dummy"`), because dummy weights make every
model emit the same tokens and hide whether attention read the right KV blocks.

Kinds:
- `hybrid-llama`: `LlamaForCausalLM` whose `layer_types` alternate sliding/full
  attention. vLLM runs it with the hybrid KV cache manager (one group per attention
  type) and it supports EAGLE3, which Gemma3 does not in vLLM 0.32.
- `eagle3-draft`: a one-layer EAGLE3 draft (`LlamaForCausalLMEagle3`) for a
  `hybrid-llama` of the same geometry, with real random weights.
- `gemma3`: a `Gemma3ForCausalLM` text model, sliding/full alternating.
- `mimo-v2`: a dense `MiMoV2FlashForCausalLM` whose sliding-window layers have a
  different KV geometry than its full layers, so the KV cache groups get different
  page sizes and vLLM gives them different block sizes. Like the published
  checkpoints it carries one MTP layer (`model.mtp.layers.0.*`, a sliding-window
  attention block), so `{"method": "mtp"}` serves it with no separate draft.
- `llama`: plain full-attention `LlamaForCausalLM` (a control with one KV group).

Every model directory carries a small tokenizer (`tokenizers` WordLevel saved as
`PreTrainedTokenizerFast`: token `wN` for most ids, whitespace-separated) with a chat
template, so `/v1/completions` (token-id prompts) and `/v1/chat/completions` both work.

torch, transformers and safetensors are imported inside functions only: `pdconnect`
must stay importable on a router pod that has none of them.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from pdconnect.testbed.paths import default_build_dir

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

__all__ = [
    "DSV4_LIKE_MIMO_V2",
    "FIRST_WORD_ID",
    "ModelKind",
    "TinyModelSpec",
    "build_model",
    "default_model_dir",
    "ensure_model",
    "ensure_target_and_draft",
    "main",
]

ModelKind = Literal["hybrid-llama", "eagle3-draft", "gemma3", "mimo-v2", "llama"]
MODEL_KINDS: tuple[str, ...] = get_args(ModelKind)

# Bump when the generated files change for an unchanged spec, so stale directories
# are rebuilt instead of silently reused. A kind whose files alone changed bumps its
# entry in KIND_REVISIONS instead: the other kinds' directories stay valid.
GENERATOR_VERSION = 2
KIND_REVISIONS: Mapping[ModelKind, int] = {"mimo-v2": 1}  # 1: the MTP layer
STAMP_FILE = "pdconnect-tinymodel.json"

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
PAD_ID, BOS_ID, EOS_ID = (SPECIAL_TOKENS.index(t) for t in ("<pad>", "<s>", "</s>"))
ROLE_TOKENS = ("system:", "user:", "assistant:")
# First id that is an ordinary word: prompts built from ids at or above it never
# contain a special token (no accidental EOS in the middle of a prompt).
FIRST_WORD_ID = len(SPECIAL_TOKENS) + len(ROLE_TOKENS)
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }} "
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    """Everything that determines a generated model; equal specs give identical files.

    The geometry fields are shared by a target and its EAGLE3 draft: a draft built from
    a spec fits the `hybrid-llama` built from the same spec (other kind, same numbers).
    """

    kind: ModelKind
    num_layers: int = 4
    hidden_size: int = 128
    intermediate_size: int = 256
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    vocab_size: int = 1000
    sliding_window: int = 64
    max_position_embeddings: int = 4096
    # Large on purpose: with the usual 0.02 a tiny random model's logits are nearly
    # flat, so greedy outputs hardly depend on the prompt.
    initializer_range: float = 0.2
    seed: int = 0
    # mimo-v2 only: the sliding-window layers' KV heads and head size. Differing from
    # the full layers' is the point: it gives the groups different page sizes.
    # The defaults give 4x the full layers' KV bytes per token, so with
    # `--block-size 64` vLLM makes SWA blocks 64 and full blocks 256 tokens: the
    # DeepSeek-V4-like geometry of docs/replay-slack.md (use `sliding_window=128` for all of it).
    swa_num_kv_heads: int = 4
    swa_head_dim: int = 64

    def __post_init__(self) -> None:
        if self.kind not in MODEL_KINDS:
            raise ValueError(f"unknown kind {self.kind!r}; expected one of {MODEL_KINDS}")
        if self.num_layers < 2 and self.kind != "llama":
            raise ValueError("hybrid models need at least 2 layers (one sliding, one full)")
        if self.vocab_size <= FIRST_WORD_ID:
            raise ValueError(f"vocab_size must exceed {FIRST_WORD_ID}")

    def with_kind(self, kind: ModelKind) -> TinyModelSpec:
        return dataclasses.replace(self, kind=kind)

    def fingerprint(self) -> str:
        """Short stable hash of the spec and generator version, for directory names."""
        payload = json.dumps(
            {"generator": GENERATOR_VERSION, **_revision(self), **dataclasses.asdict(self)}, sort_keys=True
        )
        return hashlib.sha256(payload.encode()).hexdigest()[:10]

    def layer_types(self) -> list[str]:
        """Sliding first, then alternating: the layout vLLM splits into two KV groups."""
        return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(self.num_layers)]

    def eagle_aux_layer_ids(self) -> list[int]:
        """Target layers whose outputs feed the EAGLE3 draft (three, as EAGLE3 expects).

        vLLM's default `(2, L // 2, L - 3)` is meaningless for a 4-layer target, which is
        why the draft config must name them.
        """
        last = self.num_layers - 1
        return [1, max(1, self.num_layers // 2), max(1, last)]


# docs/replay-slack.md's example geometry on a CPU engine: serve with `--block-size 64` and vLLM
# reports KV cache groups (64, 256[, 256 for an EAGLE3 draft]): SWA blocks of 64
# tokens, full-attention blocks of 256, window 128, cache-hit alignment 256.
DSV4_LIKE_MIMO_V2 = TinyModelSpec(kind="mimo-v2", sliding_window=128)

# The same groups (SWA blocks of 64, full ones of 256 with `--block-size 64`) with one KV
# head in each, so at TP2 every rank holds a replica of every head (vLLM's replicated KV
# heads), and a window of 257: its 256 tokens before the current one fill exactly one
# 256-token alignment segment (four SWA blocks). Both groups replicated, not one: a split
# group's per-rank page shrinks with TP where a replicated one's does not, so vLLM would
# give the TP1 and TP2 engines different block sizes and the pairing would be refused.
REPLICATED_KV_MIMO_V2 = TinyModelSpec(
    kind="mimo-v2", num_kv_heads=1, swa_num_kv_heads=1, swa_head_dim=128, sliding_window=257
)


def default_model_dir(spec: TinyModelSpec, root: Path | None = None) -> Path:
    """`<build>/models/<kind>-<fingerprint>`: different specs never share a directory."""
    base = root if root is not None else default_build_dir() / "models"
    return base / f"{spec.kind}-{spec.fingerprint()}"


def ensure_model(spec: TinyModelSpec, out_dir: Path | None = None) -> Path:
    """Return a directory holding the model for `spec`, generating it only if needed.

    Idempotent and safe against a concurrent generator of the same spec: the model is
    built in a sibling temporary directory and renamed into place; whoever renames
    second keeps the first one's files if they carry the same stamp.
    """
    target = out_dir if out_dir is not None else default_model_dir(spec)
    if _stamp_matches(target, spec):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the model is not a secret
    try:
        build_model(spec, staging)
        (staging / STAMP_FILE).write_text(_stamp_text(spec))
        if target.exists():
            if _stamp_matches(target, spec):
                return target
            # Built from another spec (the caller reused the directory): replace it.
            shutil.rmtree(target)
        try:
            staging.rename(target)
        except OSError:
            if not _stamp_matches(target, spec):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def ensure_target_and_draft(spec: TinyModelSpec | None = None, root: Path | None = None) -> tuple[Path, Path]:
    """A `hybrid-llama` target and an `eagle3-draft` that fits it, both generated once."""
    base = spec if spec is not None else TinyModelSpec(kind="hybrid-llama")
    target = ensure_model(base.with_kind("hybrid-llama"), default_model_dir(base.with_kind("hybrid-llama"), root))
    draft = ensure_model(base.with_kind("eagle3-draft"), default_model_dir(base.with_kind("eagle3-draft"), root))
    return target, draft


def build_model(spec: TinyModelSpec, out_dir: Path) -> None:
    """Write config, weights and tokenizer for `spec` into an existing `out_dir`."""
    builders = {
        "hybrid-llama": _build_llama,
        "llama": _build_llama,
        "gemma3": _build_gemma3,
        "eagle3-draft": _build_eagle3_draft,
        "mimo-v2": _build_mimo_v2,
    }
    builders[spec.kind](spec, out_dir)
    if spec.kind != "eagle3-draft":
        # vLLM takes the draft's tokenizer from the target.
        _build_tokenizer(spec.vocab_size).save_pretrained(str(out_dir))


# ---------------------------------------------------------------------------------------
# Builders. Models with a transformers implementation are instantiated through it (so
# the checkpoint layout is the real one); the others get hand-written tensors whose
# names follow vLLM's loaders.


def _transformer_shape(spec: TinyModelSpec) -> dict[str, Any]:
    """The transformers config keys every decoder config here shares, from the spec."""
    return {
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "max_position_embeddings": spec.max_position_embeddings,
        "initializer_range": spec.initializer_range,
    }


def _build_llama(spec: TinyModelSpec, out_dir: Path) -> None:
    from transformers import LlamaConfig

    config = LlamaConfig(
        **_transformer_shape(spec),
        tie_word_embeddings=False,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    overrides: dict[str, Any] = {}
    if spec.kind == "hybrid-llama":
        # LlamaConfig does not own these keys; writing them after save_pretrained is
        # the one way that reliably survives serialisation, and vLLM's llama.py reads
        # `layer_types` per layer.
        overrides = {"layer_types": spec.layer_types(), "sliding_window": spec.sliding_window}
    _save_transformers_model(config, spec.seed, out_dir, overrides)


def _build_gemma3(spec: TinyModelSpec, out_dir: Path) -> None:
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(
        **_transformer_shape(spec),
        query_pre_attn_scalar=spec.head_dim,
        sliding_window=spec.sliding_window,
        layer_types=spec.layer_types(),
        # Gemma ties by default; tied to an embedding scaled by sqrt(hidden), a random
        # model just echoes its last input token forever.
        tie_word_embeddings=False,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    config.architectures = ["Gemma3ForCausalLM"]
    overrides = {"layer_types": spec.layer_types(), "sliding_window": spec.sliding_window}
    _save_transformers_model(config, spec.seed, out_dir, overrides)


def _build_eagle3_draft(spec: TinyModelSpec, out_dir: Path) -> None:
    """One EAGLE3 decoder layer in the usual EAGLE3 checkpoint layout (`midlayer.*`).

    No `embed_tokens`: like published EAGLE3 heads, the draft shares the target's
    embedding. Its own `lm_head` covers the whole vocabulary, so no `d2t` map is needed.
    """
    h, kv, hd = spec.hidden_size, spec.num_kv_heads, spec.head_dim
    aux = spec.eagle_aux_layer_ids()
    shapes = {
        # The first (only) draft layer attends over [embedding ; fused hidden state].
        "midlayer.self_attn.q_proj.weight": (spec.num_heads * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, spec.num_heads * hd),
        "midlayer.mlp.gate_proj.weight": (spec.intermediate_size, h),
        "midlayer.mlp.up_proj.weight": (spec.intermediate_size, h),
        "midlayer.mlp.down_proj.weight": (h, spec.intermediate_size),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "fc.weight": (h, len(aux) * h),
        "norm.weight": (h,),
        "lm_head.weight": (spec.vocab_size, h),
    }
    _save_safetensors(_random_tensors(shapes, spec), out_dir)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "vocab_size": spec.vocab_size,
        "draft_vocab_size": spec.vocab_size,
        "target_hidden_size": h,
        "max_position_embeddings": spec.max_position_embeddings,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "dtype": "float32",
        # Without it vLLM picks (2, L//2, L-3): out of range for a 4-layer target.
        "eagle_aux_hidden_state_layer_ids": aux,
        **_special_token_ids(),
    }
    _write_json(out_dir / "config.json", config)


def _build_mimo_v2(spec: TinyModelSpec, out_dir: Path) -> None:
    """A dense MiMo-V2-Flash: vLLM's `mimo_v2.py` reads the hub's remote-code keys
    (`hybrid_layer_pattern`, `swa_*`), which transformers' own config keeps as extras.
    """
    h, ff = spec.hidden_size, spec.intermediate_size
    pattern = [1 if t == "sliding_attention" else 0 for t in spec.layer_types()]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (spec.vocab_size, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (spec.vocab_size, h),
    }
    for i, is_swa in enumerate(pattern):
        kv = spec.swa_num_kv_heads if is_swa else spec.num_kv_heads
        hd = spec.swa_head_dim if is_swa else spec.head_dim
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.self_attn.q_proj.weight": (spec.num_heads * hd, h),
            f"{p}.self_attn.k_proj.weight": (kv * hd, h),
            f"{p}.self_attn.v_proj.weight": (kv * hd, h),
            f"{p}.self_attn.o_proj.weight": (h, spec.num_heads * hd),
            f"{p}.mlp.gate_proj.weight": (ff, h),
            f"{p}.mlp.up_proj.weight": (ff, h),
            f"{p}.mlp.down_proj.weight": (h, ff),
            f"{p}.input_layernorm.weight": (h,),
            f"{p}.post_attention_layernorm.weight": (h,),
        }
    shapes |= _mimo_v2_mtp_shapes(spec)
    _save_safetensors(_random_tensors(shapes, spec), out_dir)
    config = {
        "architectures": ["MiMoV2FlashForCausalLM"],
        # vLLM serves only the first MTP layer of a MiMo-V2 (`mimo_v2_mtp.py`).
        "num_nextn_predict_layers": 1,
        "model_type": "mimo_v2_flash",
        "vocab_size": spec.vocab_size,
        "hidden_size": h,
        "intermediate_size": ff,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "v_head_dim": spec.head_dim,
        "swa_num_attention_heads": spec.num_heads,
        "swa_num_key_value_heads": spec.swa_num_kv_heads,
        "swa_head_dim": spec.swa_head_dim,
        "swa_v_head_dim": spec.swa_head_dim,
        "hybrid_layer_pattern": pattern,
        "layer_types": spec.layer_types(),
        "sliding_window": spec.sliding_window,
        "sliding_window_size": spec.sliding_window,
        # Dense everywhere: the MoE path is irrelevant to KV layout and costly on CPU.
        "moe_layer_freq": [0] * spec.num_layers,
        "mlp_layer_types": ["dense"] * spec.num_layers,
        "n_routed_experts": 1,
        "num_experts_per_tok": 1,
        "moe_intermediate_size": ff,
        "hidden_act": "silu",
        "layernorm_epsilon": 1e-6,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "swa_rope_theta": 10000.0,
        "partial_rotary_factor": 1.0,
        "attention_value_scale": None,
        "attention_bias": False,
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": False,
        "dtype": "float32",
        **_special_token_ids(),
    }
    _write_json(out_dir / "config.json", config)


def _mimo_v2_mtp_shapes(spec: TinyModelSpec) -> dict[str, tuple[int, ...]]:
    """The MTP layer `MiMoV2MTP.load_weights` reads: a sliding-window attention block
    (the `swa_*` heads) fed by [embedding ; previous hidden state] through `eh_proj`.

    Its names sort after every target layer's, and `_random_tensors` draws in sorted
    order, so the target's weights are the ones a checkpoint without it had.
    """
    h, ff = spec.hidden_size, spec.intermediate_size
    kv, hd = spec.swa_num_kv_heads, spec.swa_head_dim
    p = "model.mtp.layers.0"
    return {
        f"{p}.enorm.weight": (h,),
        f"{p}.hnorm.weight": (h,),
        f"{p}.eh_proj.weight": (h, 2 * h),
        f"{p}.input_layernorm.weight": (h,),
        f"{p}.self_attn.q_proj.weight": (spec.num_heads * hd, h),
        f"{p}.self_attn.k_proj.weight": (kv * hd, h),
        f"{p}.self_attn.v_proj.weight": (kv * hd, h),
        f"{p}.self_attn.o_proj.weight": (h, spec.num_heads * hd),
        f"{p}.pre_mlp_layernorm.weight": (h,),
        f"{p}.mlp.gate_proj.weight": (ff, h),
        f"{p}.mlp.up_proj.weight": (ff, h),
        f"{p}.mlp.down_proj.weight": (h, ff),
        f"{p}.final_layernorm.weight": (h,),
    }


# ---------------------------------------------------------------------------------------
# Shared helpers.


def _revision(spec: TinyModelSpec) -> dict[str, int]:
    """The kind's own revision, for fingerprints and stamps; absent for a kind never revised."""
    revision = KIND_REVISIONS.get(spec.kind)
    return {} if revision is None else {"revision": revision}


def _special_token_ids() -> dict[str, int]:
    return {"pad_token_id": PAD_ID, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID}


def _save_transformers_model(config: PretrainedConfig, seed: int, out_dir: Path, overrides: Mapping[str, Any]) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    if overrides:
        path = out_dir / "config.json"
        data = json.loads(path.read_text())
        data.update(overrides)
        _write_json(path, data)


def _random_tensors(shapes: Mapping[str, tuple[int, ...]], spec: TinyModelSpec) -> dict[str, torch.Tensor]:
    """Normal(0, initializer_range) matrices and unit norm weights, from one seeded
    generator in sorted-name order (so adding a tensor never reshuffles the others)."""
    import torch

    gen = torch.Generator().manual_seed(spec.seed)
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if len(shape) == 1:
            tensors[name] = torch.ones(shape, dtype=torch.float32)
        else:
            tensors[name] = torch.randn(shape, generator=gen) * spec.initializer_range
    return tensors


def _save_safetensors(tensors: Mapping[str, torch.Tensor], out_dir: Path) -> None:
    from safetensors.torch import save_file

    save_file(dict(tensors), str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def _build_tokenizer(vocab_size: int) -> Any:
    """WordLevel over `SPECIAL + ROLE + w0..wK`, whitespace-split, joined with spaces."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(vocab_size - FIRST_WORD_ID)]
    vocab = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *ROLE_TOKENS, *words))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # No word carries the "##" prefix, so this decoder just joins tokens with spaces,
    # which keeps incremental detokenisation in vLLM readable.
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 20,
    )


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _stamp_text(spec: TinyModelSpec) -> str:
    return (
        json.dumps(
            {"generator": GENERATOR_VERSION, **_revision(spec), "spec": dataclasses.asdict(spec)},
            indent=2,
            sort_keys=True,
        )
        + "\n"
    )


def _stamp_matches(path: Path, spec: TinyModelSpec) -> bool:
    try:
        return (path / STAMP_FILE).read_text() == _stamp_text(spec)
    except OSError:
        return False


# ---------------------------------------------------------------------------------------
# CLI


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    defaults = TinyModelSpec(kind="hybrid-llama")
    parser = argparse.ArgumentParser(
        prog="python -m pdconnect.testbed.tinymodel",
        description="Generate a tiny local model with seeded random weights (idempotent).",
    )
    parser.add_argument("--kind", choices=MODEL_KINDS, required=True)
    parser.add_argument(
        "--out", type=Path, default=None, help="model directory (default: build/models/<kind>-<fingerprint>)"
    )
    for field in dataclasses.fields(TinyModelSpec):
        if field.name == "kind":
            continue
        default = getattr(defaults, field.name)
        parser.add_argument(
            f"--{field.name.replace('_', '-')}", type=type(default), default=default, help=f"default: {default}"
        )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    spec = TinyModelSpec(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TinyModelSpec)})
    out = ensure_model(spec, args.out)
    print(out)
    return 0


if __name__ == "__main__":
    # Generation is single-threaded work on a few MB; keep it off the shared cores.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
