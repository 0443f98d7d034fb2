"""transformers' Gemma4AssistantForCausalLM (and Gemma4UnifiedAssistantForCausalLM) as the
drafter's oracle: a tiny assistant for a tiny target (`text_oracle.text_config`), every tensor
randomized, and its checkpoint tree."""

import numpy as np
import torch
from transformers import (
    Gemma4AssistantConfig,
    Gemma4AssistantForCausalLM,
    Gemma4UnifiedAssistantConfig,
    Gemma4UnifiedAssistantForCausalLM,
)

from tests.hf_vision import randomize_

TARGET_KEYS = ("vocab_size", "head_dim", "global_head_dim", "num_key_value_heads",
               "num_global_key_value_heads", "attention_k_eq_v", "sliding_window",
               "rope_parameters")  # fmt: skip
CLASSES = {False: (Gemma4AssistantConfig, Gemma4AssistantForCausalLM),
           True: (Gemma4UnifiedAssistantConfig, Gemma4UnifiedAssistantForCausalLM)}  # fmt: skip


def assistant_config(target, layer_types, *, ordered, tied=True, unified=False):
    """A Gemma4AssistantConfig dict for the target text config dict `target`: its attention
    geometry, `layer_types` of its own, hidden 24; ordered: the centroid head (8 centroids,
    top 2); tied: the head is model.embed_tokens (else an lm_head of its own); unified: a
    Gemma4UnifiedAssistantConfig dict instead (its gemma4_unified_text decoder has no
    per-layer-input or MoE keys)."""
    text = {k: target[k] for k in TARGET_KEYS if k in target}
    text.update(
        model_type="gemma4_text", hidden_size=24, intermediate_size=20, num_attention_heads=4,
        num_hidden_layers=len(layer_types), layer_types=list(layer_types),
        num_kv_shared_layers=len(layer_types), hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0, enable_moe_block=False, tie_word_embeddings=tied,
    )  # fmt: skip
    kind = "gemma4_assistant"
    if unified:
        for key in ("hidden_size_per_layer_input", "vocab_size_per_layer_input",
                    "enable_moe_block"):  # fmt: skip
            text.pop(key)
        text["model_type"], kind = "gemma4_unified_text", "gemma4_unified_assistant"
    return dict(model_type=kind, text_config=text,
                backbone_hidden_size=target["hidden_size"], use_ordered_embeddings=ordered,
                num_centroids=8, centroid_intermediate_top_k=2,
                tie_word_embeddings=tied)  # fmt: skip


def hf_assistant(config, seed, drafts=None):
    """A randomized float32 eager Gemma4AssistantForCausalLM (Gemma4UnifiedAssistantForCausalLM
    for a unified config) of `assistant_config`'s dict; its token_ordering a random
    permutation; drafts: its generation_config's num_assistant_tokens."""
    kind, cls = CLASSES[config["model_type"] == "gemma4_unified_assistant"]
    cfg = kind(**{k: v for k, v in config.items() if k != "model_type"})
    cfg._attn_implementation = "eager"
    cfg.text_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    randomize_(model.model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.startswith("model.") or (name == "lm_head.weight" and cfg.tie_word_embeddings):
                continue
            if name.endswith("token_ordering"):
                t.copy_(torch.randperm(t.shape[0], generator=g))
            else:
                t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float64) / t.shape[1] ** 0.5)
    model.generation_config.num_assistant_tokens = drafts
    return model


def assistant_params(model):
    """The assistant's checkpoint tree as `ref.gemma4.assistant.Assistant` reads it (numpy;
    a tied head saved once, as `model.embed_tokens.weight`)."""
    from ref.gemma4.params import nested

    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    names = sorted(state)
    leaves = [state[n].numpy().astype(np.int32 if "ordering" in n else np.float32) for n in names]
    return nested(names, leaves)


def repeating_assistant(target, table, layer_types, seed=3, unified=False):
    """A Gemma4AssistantForCausalLM for `target` (text config dict) that drafts the last token
    again: hidden = backbone, pre_projection passes the target's scaled embedding through,
    every layer adds nothing (o_proj and down_proj zero), the final norm scales by one and the
    tied head is the target's embedding `table` [V, D] (a torch tensor); so each draft is
    argmax_id table[id] · table[t] (t itself unless a longer row points its way). Greedy
    random targets repeat tokens in runs, so its drafts are accepted now and then: rounds
    with every acceptance count happen. unified: a Gemma4UnifiedAssistantForCausalLM."""
    config = assistant_config(target, layer_types, ordered=False, unified=unified)
    config["text_config"]["hidden_size"] = target["hidden_size"]
    model = hf_assistant(config, seed)
    d = target["hidden_size"]
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name == "pre_projection.weight":
                t.zero_()
                t[:, :d] = torch.eye(d)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                t.zero_()
            elif name in ("model.norm.weight",) or name.endswith("layer_scalar"):
                t.fill_(1.0)
            elif name == "model.embed_tokens.weight":
                t.copy_(table)
    return model
