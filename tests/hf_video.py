"""A stand-in for transformers' Gemma4VideoProcessor where torchvision does not import beside
this torch: transformers' own frame sampling (`default_sample_indices_fn`), target size
(`get_aspect_ratio_preserving_size`), patch order and padding (the image processor's
`convert_image_to_patches`, `pad_along_first_dim`), and torch's uint8 antialiased bicubic
resize, which torchvision's `resize` runs for uint8 frames on CPU. It returns what
Gemma4VideoProcessor returns, so Gemma4Processor expands the prompt and Gemma4Model embeds
the frames from it. Nothing here comes from `ref`."""

import numpy as np
import torch
from transformers.feature_extraction_utils import BatchFeature
from transformers.models.gemma4.image_processing_pil_gemma4 import (
    convert_image_to_patches,
    get_aspect_ratio_preserving_size,
    pad_along_first_dim,
)
from transformers.video_utils import VideoMetadata, default_sample_indices_fn


class VideoStandIn:
    """Gemma4VideoProcessor(patch_size, max_soft_tokens, num_frames) on [T, H, W, 3] uint8
    videos; fps: each video's frame rate (None: unknown, the processor then uses 24)."""

    model_input_names = ["pixel_values_videos", "video_position_ids", "num_frames_per_video"]

    def __init__(self, patch_size, max_soft_tokens, num_frames, fps, pooling_kernel_size=3):
        self.patch, self.budget, self.num_frames = patch_size, max_soft_tokens, num_frames
        self.fps, self.k = list(fps), pooling_kernel_size

    def __call__(self, videos, return_tensors=None, **kwargs):
        max_patches = self.budget * self.k**2
        values, positions, frames_per, soft, metadata = [], [], [], [], []
        for video, fps in zip(videos, self.fps, strict=True):
            video = np.asarray(video)
            meta = VideoMetadata(total_num_frames=len(video), fps=fps)
            meta.frames_indices = default_sample_indices_fn(meta, num_frames=self.num_frames)
            h, w = get_aspect_ratio_preserving_size(
                *video.shape[1:3], self.patch, max_patches, self.k
            )
            frames = torch.from_numpy(video[meta.frames_indices]).permute(0, 3, 1, 2)
            if (h, w) != tuple(video.shape[1:3]):
                frames = torch.nn.functional.interpolate(
                    frames.contiguous(), size=[h, w], mode="bicubic", antialias=True
                )
            pixels = frames.float().numpy() / np.float32(255)
            grid = np.stack(np.meshgrid(np.arange(w // self.patch), np.arange(h // self.patch)), -1)
            for frame in pixels:
                p, pos = pad_along_first_dim(
                    convert_image_to_patches(frame, self.patch), grid.reshape(-1, 2), max_patches
                )
                values.append(p)
                positions.append(pos)
            frames_per.append(len(pixels))
            soft.append((h // self.patch) * (w // self.patch) // self.k**2)
            metadata.append(meta)
        data = {
            "pixel_values_videos": torch.from_numpy(np.stack(values)),
            "video_position_ids": torch.from_numpy(np.stack(positions)),
            "num_frames_per_video": torch.tensor(frames_per),
            "num_soft_tokens_per_video": soft,
            "video_metadata": metadata,
        }
        return BatchFeature(data)
