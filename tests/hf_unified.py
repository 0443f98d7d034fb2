"""transformers' Gemma 4 12B Unified as the oracle: a tiny randomized
Gemma4UnifiedForConditionalGeneration, and Gemma4UnifiedProcessor built without a download
and without torchvision.

torchvision does not import beside this torch (DESIGN.md), and transformers'
image_processing_gemma4_unified and video_processing_gemma4_unified import it at the top for
`tvF.resize` alone. They are imported here with a stand-in `torchvision.transforms.v2.functional`
module in sys.modules (removed again at once), so their own `get_aspect_ratio_preserving_size`,
`convert_image_to_patches`, `convert_video_to_patches`, `patches_merge`, `pad_along_first_dim`
and `pad_to_max_patches` run here; the resize is torch's uint8 antialiased bicubic, which
torchvision's `resize` runs for uint8 images on CPU, and the rescale is the torchvision
backend's (`x * (1/255)` for images, its fused normalize `x / 255` for video). Nothing here
comes from `ref`.
"""

import importlib
import sys
import types

import numpy as np
import pytest
import torch
from transformers import Gemma4UnifiedConfig, Gemma4UnifiedForConditionalGeneration
from transformers.feature_extraction_utils import BatchFeature
from transformers.models.gemma4_unified.feature_extraction_gemma4_unified import (
    Gemma4UnifiedAudioFeatureExtractor,
)
from transformers.models.gemma4_unified.processing_gemma4_unified import Gemma4UnifiedProcessor
from transformers.processing_utils import ProcessorMixin
from transformers.video_utils import VideoMetadata, default_sample_indices_fn

from tests.hf_vision import randomize_
from tests.text_oracle import AUDIO, BOA, BOI, EOA, EOI, IMAGE, text_config, top2_gap

VIDEO = 7  # the word tokenizer's <|video|> (tests/hf_processor.py)


def _import_without_torchvision():
    names = ["torchvision", "torchvision.transforms", "torchvision.transforms.v2"]
    stubs = {n: types.ModuleType(n) for n in [*names, "torchvision.transforms.v2.functional"]}
    stubs["torchvision.transforms.v2"].functional = stubs["torchvision.transforms.v2.functional"]
    stubs["torchvision.transforms.v2.functional"].InterpolationMode = object  # annotations only
    saved = {n: sys.modules.get(n) for n in stubs}
    sys.modules.update(stubs)
    try:
        package = "transformers.models.gemma4_unified."
        img = importlib.import_module(package + "image_processing_gemma4_unified")
        vid = importlib.import_module(package + "video_processing_gemma4_unified")
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m
    return img, vid


IMG, VID = _import_without_torchvision()


def _resize(chw, height, width):
    """torch's uint8 antialiased bicubic, skipped at the same size. [..., C, H, W] uint8."""
    if tuple(chw.shape[-2:]) == (height, width):
        return chw
    batched = chw if chw.ndim == 4 else chw[None]
    out = torch.nn.functional.interpolate(
        batched.contiguous(), size=[height, width], mode="bicubic", antialias=True
    )
    return out if chw.ndim == 4 else out[0]


def _teacher_positions(height, width, patch):
    grid = torch.meshgrid(
        torch.arange(width // patch), torch.arange(height // patch), indexing="xy"
    )
    return torch.stack(grid, dim=-1).reshape(-1, 2)


class ImageStandIn:
    """Gemma4UnifiedImageProcessor._preprocess on uint8 [H, W, 3] arrays (patch 16, k 3)."""

    model_input_names = ["pixel_values", "image_position_ids", "num_soft_tokens_per_image"]

    def __init__(self, max_soft_tokens, patch_size=16, pooling_kernel_size=3):
        self.budget, self.patch, self.k = max_soft_tokens, patch_size, pooling_kernel_size

    def fetch_images(self, images):
        """Arrays pass through (the processor asks every image processor to load URLs)."""
        return images

    def __call__(self, images, return_tensors=None, **kwargs):
        flat = [im for row in images for im in row] if isinstance(images[0], list) else images
        values, positions, soft = [], [], []
        for image in flat:
            chw = torch.from_numpy(np.asarray(image)).permute(2, 0, 1)
            h, w = IMG.get_aspect_ratio_preserving_size(
                *chw.shape[1:], self.patch, self.budget * self.k**2, self.k
            )
            pixels = _resize(chw, h, w) * (1 / 255)
            teacher = IMG.convert_image_to_patches(pixels, self.patch)
            n = teacher.shape[0] // self.k**2
            merged, pos = IMG.patches_merge(
                teacher[None], _teacher_positions(h, w, self.patch)[None], n
            )
            p, q = IMG.pad_along_first_dim(merged[0], pos[0], self.budget)
            values.append(p)
            positions.append(q)
            soft.append(n)
        data = {
            "pixel_values": torch.stack(values),
            "image_position_ids": torch.stack(positions),
            "num_soft_tokens_per_image": soft,
        }
        return BatchFeature(data)


class VideoStandIn:
    """Gemma4UnifiedVideoProcessor on [T, H, W, 3] uint8 videos (32 frames sampled, budget 70
    by default); fps: each video's frame rate (None: unknown, the processor then uses 24)."""

    model_input_names = ["pixel_values_videos", "video_position_ids", "num_frames_per_video"]

    def __init__(self, fps, max_soft_tokens=70, num_frames=32, patch_size=16, k=3):
        self.fps, self.budget, self.num_frames = list(fps), max_soft_tokens, num_frames
        self.patch, self.k = patch_size, k

    def __call__(self, videos, return_tensors=None, **kwargs):
        values, positions, frames_per, soft, metadata = [], [], [], [], []
        for video, fps in zip(videos, self.fps, strict=True):
            video = np.asarray(video)
            meta = VideoMetadata(total_num_frames=len(video), fps=fps)
            meta.frames_indices = default_sample_indices_fn(meta, num_frames=self.num_frames)
            h, w = VID.get_aspect_ratio_preserving_size(
                *video.shape[1:3], self.patch, self.budget * self.k**2, self.k
            )
            frames = torch.from_numpy(video[meta.frames_indices]).permute(0, 3, 1, 2)
            pixels = _resize(frames, h, w).float() / 255
            teacher = VID.convert_video_to_patches(pixels, self.patch)
            pos = _teacher_positions(h, w, self.patch)[None].repeat(len(pixels), 1, 1)
            n = teacher.shape[1] // self.k**2
            merged, pos = VID.patches_merge(teacher, pos, n)
            merged, pos = VID.pad_to_max_patches(merged, pos, self.budget)
            values.append(merged)
            positions.append(pos)
            frames_per.append(len(pixels))
            soft.append(n)
            metadata.append(meta)
        data = {
            "pixel_values_videos": torch.cat(values),
            "video_position_ids": torch.cat(positions),
            "num_frames_per_video": torch.tensor(frames_per),
            "num_soft_tokens_per_video": soft,
            "video_metadata": metadata,
        }
        return BatchFeature(data)


def unified_processor(tokenizer, budget, video=None):
    """Gemma4UnifiedProcessor with the stand-ins above and its real feature extractor; only
    the image and video processors' class checks are skipped."""
    check = ProcessorMixin.check_argument_for_proper_class

    def lenient(self, name, arg):
        if name in ("image_processor", "video_processor"):
            return None
        return check(self, name, arg)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ProcessorMixin, "check_argument_for_proper_class", lenient)
        return Gemma4UnifiedProcessor(
            feature_extractor=Gemma4UnifiedAudioFeatureExtractor(),
            image_processor=ImageStandIn(budget),
            tokenizer=tokenizer,
            video_processor=video,
        )


MM_EMBED = 24  # the tiny vision embedder's width (mm_embed_dim = output_proj_dims)


def unified_config(posemb=64, samples=640):
    """A tiny Gemma4UnifiedConfig: 2 layers (sliding, full; attention_k_eq_v on the full one),
    vision (48-px blocks, table of `posemb` rows per axis), audio (`samples` per frame)."""
    text = text_config(
        moe=False, layer_types=["sliding_attention", "full_attention"], k_eq_v=True, ple=0
    )
    for key in ("vocab_size_per_layer_input", "hidden_size_per_layer_input", "enable_moe_block"):
        text.pop(key)
    for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
        text.pop(key)
    vision = dict(mm_embed_dim=MM_EMBED, output_proj_dims=MM_EMBED, mm_posemb_size=posemb)
    config = Gemma4UnifiedConfig(
        text_config=text,
        vision_config=vision,
        audio_config={"audio_embed_dim": samples},
        image_token_id=IMAGE,
        boi_token_id=BOI,
        eoi_token_id=EOI,
        video_token_id=VIDEO,
        audio_token_id=AUDIO,
        boa_token_id=BOA,
        eoa_token_index=EOA,
    )
    for part in (config, config.text_config, config.vision_config, config.audio_config):
        part._attn_implementation = "eager"
    return config


def randomize_embedder_(module, seed):
    """Every tensor of an embedder random, away from neutral: LayerNorm weights around 1 and
    biases around 0, linears N(0, 1/in), the position table N(0, 0.25)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in module.state_dict().items():
            new = torch.randn(t.shape, generator=g, dtype=torch.float64)
            if name.endswith("pos_embedding"):
                new = 0.5 * new
            elif t.ndim == 2:
                new = new / np.sqrt(t.shape[1])
            elif name.endswith("weight"):
                new = 1 + 0.2 * new
            else:
                new = 0.3 * new
            t.copy_(new.to(t.dtype))
    return module


# as tests/text_oracle.py's EMBED_SCALE: the tokens follow the soft tokens, not the last word
EMBED_SCALE = 0.03


def hf_unified(seed=5, **config):
    """A randomized float32 eager Gemma4UnifiedForConditionalGeneration (unified_config)."""
    torch.manual_seed(seed)
    model = Gemma4UnifiedForConditionalGeneration(unified_config(**config)).eval()
    m = model.model
    randomize_(m.language_model, seed)
    randomize_embedder_(m.embed_vision, seed + 1)
    randomize_embedder_(m.embed_audio, seed + 2)
    with torch.no_grad():
        m.language_model.embed_tokens.weight.mul_(EMBED_SCALE)
        m.language_model.norm.weight.mul_(1 / EMBED_SCALE)
    return model


HF_INPUTS = ("input_ids", "attention_mask", "mm_token_type_ids", "pixel_values")
HF_INPUTS += ("image_position_ids", "pixel_values_videos", "video_position_ids")
HF_INPUTS += ("num_frames_per_video", "input_features", "input_features_mask")


def hf_greedy(hf, inputs, new_tokens):
    """transformers' greedy `generate` with a static cache → (new ids, least top-2 gap).

    With a static cache transformers masks the prompt through the model's own
    `create_masks_for_generate` (`create_masks_for_vision_model`: vision blocks bidirectional
    on sliding layers only, inside the window), as Gemma 4 does; with the default dynamic cache
    Gemma4UnifiedModel.forward calls masking_utils' generic one instead, which opens the
    blocks on full layers too and past the window (measured: other tokens from the second on).
    `ref` follows the former, Gemma 4's rule."""
    with torch.no_grad():
        out = hf.generate(
            **inputs, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
            cache_implementation="static", output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    gap = top2_gap(np.stack([x[0].numpy() for x in out.logits]))
    return out.sequences[0, inputs["input_ids"].shape[1] :].numpy(), gap
