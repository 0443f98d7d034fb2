"""The embedded default model: a tiny Gemma 4 config and its deterministic random checkpoint.

`python -m codegen export` without `--model` writes this checkpoint once (a real config.json +
model.safetensors, bfloat16 like the published ones) and exports from it, so the default run
takes the same path as a downloaded model. It holds every tensor of a Gemma 4 VLM: the vision
tower, `embed_vision` and the whole text decoder (per-layer embeddings, KV sharing, k_eq_v).

Random weights: every buffer that defaults to a neutral value (position table, clip bounds,
std_bias/std_scale) is randomized so a bug in it shows, and the q/k norm weights are scaled
down (unscaled attention on RMS-normed q/k is sharp) so float32 noise stays small through the
layers.
"""

import json
import os
from pathlib import Path

import ml_dtypes
import numpy as np

from codegen.folder.hashcache import cache_root
from codegen.folder.sessions import atomic_text
from ref.gemma4.config import VisionConfig
from ref.gemma4.params import EMBED_VISION, VISION, text_param_shapes, vision_param_shapes
from ref.gemma4.text_config import TextConfig

DEFAULT_CONFIG = {
    "architectures": ["Gemma4ForConditionalGeneration"],
    "model_type": "gemma4",
    "vision_config": {
        "model_type": "gemma4_vision",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "axial", "rope_theta": 100.0},
        "pooling_kernel_size": 3,
        "patch_size": 4,
        "position_embedding_size": 64,
        "use_clipped_linears": True,
        "standardize": True,
    },
    "text_config": {
        "model_type": "gemma4_text",
        "vocab_size": 256,
        "hidden_size": 48,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        # layer 0 sliding (window 8 < seq_len 16: it bites), layer 1 full with a wider head,
        # proportional RoPE, values = keys (attention_k_eq_v); layers 2 and 3 reuse the keys
        # and values of 0 and 1 (KV sharing); per-layer embeddings; bidirectional vision runs
        "layer_types": [
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "full_attention",
        ],
        "sliding_window": 8,
        "global_head_dim": 32,
        "num_global_key_value_heads": 2,
        "attention_k_eq_v": True,
        "num_kv_shared_layers": 2,
        "hidden_size_per_layer_input": 8,
        "vocab_size_per_layer_input": 256,
        "final_logit_softcapping": 30.0,
        "use_bidirectional_attention": "vision",
        "pad_token_id": 0,
    },
    "image_token_id": 4,
    "boi_token_id": 5,
    "eoi_token_id": 6,
    "video_token_id": 7,
    "pad_token_id": 0,
    "bos_token_id": 2,
    "eos_token_id": 1,
}
SEED = 20260


def _random(name, shape, rng):
    """One tensor: values whose scale suits what the name says it is."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("input_min", "output_min"):
        return -rng.uniform(0.5, 3.0, shape)
    if leaf in ("input_max", "output_max"):
        return rng.uniform(0.5, 3.0, shape)
    if "position_embedding_table" in name:
        return rng.normal(0.0, 0.5, shape)
    if leaf == "std_bias":
        return rng.normal(0.0, 0.2, shape)
    if leaf == "std_scale":
        return rng.uniform(0.5, 1.5, shape)
    if len(shape) == 1:
        scale = 0.25 if ("q_norm" in name or "k_norm" in name) else 1.0
        return scale * rng.uniform(0.5, 1.5, shape)
    return rng.normal(0.0, shape[-1] ** -0.5, shape)


def default_tensors(config=None, seed=SEED):
    """{checkpoint name: bfloat16 array} of the default model (deterministic in `seed`)."""
    config = DEFAULT_CONFIG if config is None else config
    vision = VisionConfig.from_hf(config)
    shapes = {VISION + n: s for n, s in vision_param_shapes(vision).items()}
    shapes[EMBED_VISION] = (vision.text_hidden_size, vision.hidden_size)
    shapes.update(text_param_shapes(TextConfig.from_hf(config)))
    rng = np.random.default_rng(seed)
    return {
        name: np.asarray(_random(name, shape, rng)).astype(ml_dtypes.bfloat16)
        for name, shape in sorted(shapes.items())
    }


def cache_dir():
    """Where the default checkpoint lives: in `hashcache.cache_root()`."""
    return cache_root() / f"default-model-{SEED}"


# The default tokenizer: Gemma 4's special tokens at the ids DEFAULT_CONFIG names, then words,
# then Gemma 4's turn markers and roles, then filler up to the vocabulary size (a word-level
# stand-in for Gemma's 262k SentencePiece).
SPECIAL_TOKENS = (
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<|image|>",
    "<|image>",
    "<image|>",
    "<|video|>",
)
WORDS = (
    "a an the this that these those it its is are was be and or but not of in on at to for "
    "with from by as what which who where when how why describe tell me show write answer "
    "image picture photo video frame color colour red green blue black white gray yellow "
    "small large big left right top bottom middle there here one two three many some all "
    "cat dog person people car tree sky sun house road water text sign light dark . , : ? !"
).split() + [f"{i:02d}" for i in range(60)]  # a video frame's "mm:ss" timestamp
TURN_TOKENS = ("<|turn>", "<turn|>")  # a turn's start and end, as Gemma 4's tokenizer names them
ROLES = ("user", "model", "system")
# Gemma 4's turn markup (`<|turn>role` … `<turn|>`, the assistant's role written "model"), one
# placeholder per image or video where the message puts it
CHAT_TEMPLATE = """{{ bos_token }}
{%- for message in messages -%}
{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
{{ '<|turn>' + role + '\n' }}
{%- if message['content'] is string -%}
{{ message['content'] | trim }}
{%- else -%}
{%- for item in message['content'] -%}
{%- if item['type'] == 'image' -%}{{ '<|image|>' }}
{%- elif item['type'] == 'video' -%}{{ '<|video|>' }}
{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
{{ '<turn|>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|turn>model\n' }}{%- endif -%}
"""


def default_tokenizer():
    """A `tokenizers` Tokenizer for the default model (word level, lower-cased, split on
    whitespace and punctuation)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    vocab_size = DEFAULT_CONFIG["text_config"]["vocab_size"]
    tokens = list(SPECIAL_TOKENS) + list(WORDS) + list(TURN_TOKENS) + list(ROLES)
    tokens += [f"<unused{i}>" for i in range(vocab_size - len(tokens))]
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, "<unk>"))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    backend.add_special_tokens(list(SPECIAL_TOKENS) + list(TURN_TOKENS))
    return backend


def default_side_files():
    """{file name: text} written beside the default checkpoint: the chat template, the
    tokenizer's named special tokens, and the generation config (stop at `<eos>` or the end of
    a turn; Gemma's sampling defaults)."""
    ids = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    end_of_turn = len(SPECIAL_TOKENS) + len(WORDS) + 1
    generation = {
        "bos_token_id": ids["<bos>"],
        "eos_token_id": [ids["<eos>"], end_of_turn],
        "pad_token_id": ids["<pad>"],
        "do_sample": True,
        "top_k": 64,
        "top_p": 0.95,
    }
    tokenizer = {
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "image_token": "<|image|>",
        "boi_token": "<|image>",
        "eoi_token": "<image|>",
        "video_token": "<|video|>",
    }
    return {
        "chat_template.jinja": CHAT_TEMPLATE,
        "tokenizer_config.json": json.dumps(tokenizer, indent=2) + "\n",
        "generation_config.json": json.dumps(generation, indent=2) + "\n",
    }


def default_checkpoint(folder=None):
    """The default checkpoint's folder (config.json, model.safetensors, tokenizer.json and the
    side files), written on first use (atomically: the weights by `weights`, the others each by
    a rename)."""
    from weights import save_checkpoint

    folder = cache_dir() if folder is None else Path(folder)
    config_path = folder / "config.json"
    side = default_side_files()
    files = ("model.safetensors", "tokenizer.json", *side)
    if config_path.is_file() and all((folder / f).is_file() for f in files):
        try:
            same = all((folder / n).read_text() == text for n, text in side.items())
            if same and json.loads(config_path.read_text()) == DEFAULT_CONFIG:
                return folder
        except (OSError, ValueError):
            pass
    save_checkpoint(folder, DEFAULT_CONFIG, default_tensors(), overwrite=True)
    tmp = folder / "tokenizer.json.tmp"
    default_tokenizer().save(str(tmp))
    os.replace(tmp, folder / "tokenizer.json")
    for name, text in side.items():
        atomic_text(folder / name, text)
    return folder
