"""transformers' Gemma4ForConditionalGeneration as the text oracle: tiny configs, every tensor
randomized, and the same model as a checkpoint tree for `ref`."""

import numpy as np
import torch
from transformers import Gemma4Config, Gemma4ForConditionalGeneration

from tests.hf_audio import TINY_AUDIO, randomize_audio_
from tests.hf_vision import hf_padded_inputs, patches_for, randomize_

IMAGE, BOI, EOI = 4, 5, 6
AUDIO, BOA, EOA = 8, 9, 10  # the word tokenizer's (tests/hf_processor.py), for models with audio
FIRST_TEXT = 7  # prompt tokens are drawn from [FIRST_TEXT, vocab)

VISION = {
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "patch_size": 2,
    "position_embedding_size": 16,
    "pooling_kernel_size": 3,
    "use_clipped_linears": True,
    "standardize": True,
    "rope_parameters": {"rope_type": "axial", "rope_theta": 100.0},
}


def text_config(*, moe, layer_types, shared=0, k_eq_v=False, ple=16, softcap=30.0, window=6):
    """Kwargs of a tiny Gemma4TextConfig in the shape of transformers' own test config."""
    return dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=len(layer_types),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        global_head_dim=16,
        num_global_key_value_heads=1 if k_eq_v else None,
        attention_k_eq_v=k_eq_v,
        layer_types=list(layer_types),
        num_kv_shared_layers=shared,
        sliding_window=window,
        vocab_size_per_layer_input=96,
        hidden_size_per_layer_input=ple,
        enable_moe_block=moe,
        num_experts=4 if moe else None,
        top_k_experts=2 if moe else None,
        moe_intermediate_size=12 if moe else None,
        use_bidirectional_attention="vision",
        final_logit_softcapping=softcap,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": 0.5,
                "rope_theta": 1_000_000.0,
            },
        },
    )


def hf_model(text, seed, video_token_id=None, audio=None, **vision):
    """A randomized float32 eager Gemma4ForConditionalGeneration with a tiny vision tower
    (VISION, updated by `vision`); video_token_id: None keeps Gemma4Config's (past any tiny
    vocabulary); audio: None (no audio tower), or Gemma4AudioConfig kwargs: an audio tower and
    embed_audio too (randomized by `randomize_audio_`), its tokens AUDIO, BOA, EOA."""
    tokens = {} if video_token_id is None else {"video_token_id": video_token_id}
    if audio is not None:
        tokens |= dict(audio_config=audio, audio_token_id=AUDIO, boa_token_id=BOA)
        tokens["eoa_token_index"] = EOA  # Gemma4Config's name for it
    config = Gemma4Config(
        text_config=text,
        vision_config={**VISION, **vision},
        image_token_id=IMAGE,
        boi_token_id=BOI,
        eoi_token_id=EOI,
        **tokens,
    )
    for part in (config, config.text_config, config.vision_config, config.audio_config):
        if part is not None:
            part._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(config).eval()
    if audio is None:
        return randomize_(model, seed)
    m = model.model
    for i, part in enumerate((m.language_model, m.vision_tower, m.embed_vision)):
        randomize_(part, seed + i)
    randomize_audio_(m.audio_tower, seed + 3)
    randomize_audio_(m.embed_audio, seed + 4)
    return model


def prompt(rng, length, images, vocab):
    """Token ids [length + runs]: text with each image's run `BOI IMAGE×n EOI` at random places.

    images: soft-token counts per image, in order.
    """
    text = list(rng.integers(FIRST_TEXT, vocab, size=length))
    cuts = sorted(rng.integers(0, length + 1, size=len(images)))
    ids, start = [], 0
    for cut, n in zip(cuts, images, strict=True):
        ids += text[start:cut] + [BOI] + [IMAGE] * n + [EOI]
        start = cut
    return np.array(ids + text[start:], np.int64)


def hf_generate(model, ids, patches, grids, max_new_tokens, eos="model", **generation):
    """Greedy generation for one prompt, as transformers ends it: (new tokens [N], N ≤
    max_new_tokens, ending at the first stop id; per-step logits [N, V], before any logits
    processor).

    eos: "model" (the model's generation_config: Gemma 4's `<eos>` 1), a stop id or a list of
    them, or None (never stop); generation: further generation_config fields (e.g.
    suppress_tokens)."""
    kwargs = {} if eos == "model" else {"eos_token_id": eos}
    kwargs.update(generation)
    if grids:
        kwargs["pixel_values"], kwargs["image_position_ids"] = hf_padded_inputs(patches, grids)
    input_ids = torch.from_numpy(ids)[None]
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            mm_token_type_ids=(input_ids == IMAGE).long(),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
            **kwargs,
        )
    tokens = out.sequences[0, len(ids) :].numpy()
    return tokens, np.stack([x[0].numpy() for x in out.logits])


def top2_gap(logits):
    """The least gap between the two largest logits over steps: [N, V] → float (below ~1e-4,
    float32 runs may pick either token)."""
    top2 = np.sort(np.asarray(logits), axis=-1)[:, -2:]
    return float((top2[:, 1] - top2[:, 0]).min())


def hf_request(model, rng, length, grids, new_tokens, vocab=96, eos="model"):
    """One random request and transformers' answer to it alone: `length` text ids with a run
    of image tokens per grid (h·w/9 soft tokens) at random places, each image's random
    patches (2×2 pixels: patches_for's 12 values) → (ids, patches, tokens, top2_gap); eos as
    `hf_generate`'s."""
    patches = patches_for(grids, rng, 12)
    ids = prompt(rng, length, [h * w // 9 for h, w in grids], vocab)
    tokens, logits = hf_generate(model, ids, patches, grids, new_tokens, eos=eos)
    return ids, patches, tokens, top2_gap(logits)


def padded_rows(rows, pad=0):
    """Rows of generated ids as transformers returns a batch: each padded with `pad` to the
    longest → [B, max len]."""
    width = max(len(r) for r in rows)
    return np.stack([np.pad(np.asarray(r), (0, width - len(r)), constant_values=pad) for r in rows])


# With the randomized token embedding (N(0, 1), ×√hidden in the stream) every greedy token
# repeats the prompt's last one whatever the audio (measured: 10 of 10, two clips swapped); at
# ×0.03, the final norm ×1/0.03 keeping the logits' scale, the tokens follow the clips.
EMBED_SCALE = 0.03


def hf_audio_vlm():
    """The tiny Gemma 4 with vision (position table 256), audio (TINY_AUDIO) and embed_audio
    the audio prompt tests share: bidirectional vision on its sliding layers, the token
    embedding ×EMBED_SCALE so the greedy tokens follow the clips."""
    text = text_config(moe=False, layer_types=["sliding_attention", "full_attention"], ple=8)
    hf = hf_model(text, 3, 7, audio=TINY_AUDIO, position_embedding_size=256)
    with torch.no_grad():
        hf.model.language_model.embed_tokens.weight.mul_(EMBED_SCALE)
        hf.model.language_model.norm.weight.mul_(1 / EMBED_SCALE)
    return hf
