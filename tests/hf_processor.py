"""transformers' Gemma4Processor built without a download: a word-level tokenizer made with the
`tokenizers` library that holds Gemma 4's special tokens, and the PIL image processor."""

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
from transformers.models.gemma4.processing_gemma4 import Gemma4Processor
from transformers.processing_utils import ProcessorMixin

from tests.text_oracle import top2_gap

# ids 0–6 as tests/text_oracle.py's models use them: pad, eos, bos, unk, image, boi, eoi
SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<|image|>", "<|image>", "<image|>", "<|video|>"]
SPECIAL += ["<|audio|>", "<|audio>", "<audio|>"]
WORDS = ["look", "at", "this", "and", "then", "that", ":", ".", "?"]
WORDS += [f"{i:02d}" for i in range(60)]
TURN = ["<|turn>", "<turn|>"]  # Gemma 4's turn markers and roles, after the words: ids unchanged
ROLES = ["user", "model"]


def word_backend():
    """The `tokenizers` Tokenizer: SPECIAL, WORDS, TURN, ROLES, split on whitespace and
    punctuation."""
    vocab = SPECIAL + WORDS + TURN + ROLES
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, "<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(SPECIAL + TURN)
    return backend


def word_tokenizer():
    """The backend as transformers' fast tokenizer with Gemma 4's named special tokens."""
    named = {"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>"}
    named |= {"audio_token": "<|audio|>", "boa_token": "<|audio>", "eoa_token": "<audio|>"}
    return PreTrainedTokenizerFast(
        tokenizer_object=word_backend(),
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        extra_special_tokens=named,
    )


def hf_processor(tokenizer, budget, patch_size, video=None, chat_template=None):
    """Gemma4Processor with a real PIL image processor; `video` may be None (torchvision does
    not import beside this torch) or a stand-in (tests/hf_video.py): only that argument's
    class check is skipped; chat_template: the processor's template (apply_chat_template)."""
    image = Gemma4ImageProcessorPil(patch_size=patch_size, max_soft_tokens=budget)
    check = ProcessorMixin.check_argument_for_proper_class

    def lenient(self, name, arg):
        return None if name == "video_processor" else check(self, name, arg)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ProcessorMixin, "check_argument_for_proper_class", lenient)
        return Gemma4Processor(
            feature_extractor=Gemma4AudioFeatureExtractor(),
            image_processor=image,
            tokenizer=tokenizer,
            video_processor=video,
            chat_template=chat_template,
        )


def greedy_with_gap(model, inputs, new_tokens):
    """transformers' greedy `generate` on processor outputs, stopping at the model's stop ids
    → (the new ids of row 0, the least top-2 logit gap over its steps: below ~1e-4 float32 runs
    may pick either)."""
    with torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    gap = top2_gap(np.stack([x[0].numpy() for x in out.logits]))
    return out.sequences[0, inputs["input_ids"].shape[1] :].numpy(), gap
