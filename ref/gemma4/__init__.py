"""Gemma 4 reference: the packed vision tower and the whole vision-language model.

tower = VisionTower.from_pretrained(model_dir)
feats = tower.encode(patches, grids)   # list of [h·w/9, vision_hidden], one per item
embs = tower.embed(patches, grids)     # the same after embed_vision (full models only)
tokens = Gemma4.from_pretrained(model_dir).generate(input_ids, patches, grids,
                                                    max_new_tokens=16)
unified = Gemma4Unified.from_pretrained(gemma_4_12b_dir)   # the 12B Unified: no towers
tokens = unified.generate_from("Look <|image|>", [photo], tokenize=tok, max_new_tokens=16)
"""

from ref.gemma4.config import VisionConfig
from ref.gemma4.model import Gemma4
from ref.gemma4.packing import Packing, pack
from ref.gemma4.tower import VisionTower, tower_forward
from ref.gemma4.unified_model import Gemma4Unified

__all__ = [
    "Gemma4",
    "Gemma4Unified",
    "Packing",
    "VisionConfig",
    "VisionTower",
    "pack",
    "tower_forward",
]
