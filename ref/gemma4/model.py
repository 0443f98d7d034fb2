"""`Gemma4`: the multimodal model end to end — images through the packed vision tower, audio
through the packed audio tower, chunked prefill of the prompt, greedy decode — with a
blocked-attention mode per phase.

The chunk schedule is host-side numpy; every step is `ref.gemma4.step.step` on fixed shapes
([B, S] prefill chunks, [B, 1] decode tokens), the same step a compiled graph runs.

Audio enters the step as vision does: a clip's soft tokens (after embed_audio) are rows of the
step's `vision_embeds`, one stream per batch row with its images' and video frames' in order of
appearance, read at the placeholders by the running `image_idx`. Only the mask tells them apart:
audio runs are causal (never a bidirectional vision run), so a chunk may cut one (the running
index carries on in the next chunk), and the schedule keeps only vision runs whole.
"""

import copy
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from ref import moe_modes, sharding, validate
from ref.attention import blocked, reference
from ref.blocking import BlockingConfig, for_phase
from ref.gemma4 import decoding, speculative
from ref.gemma4.audio_tower import AudioTower
from ref.gemma4.images import VIDEO_FRAMES, VIDEO_SOFT_TOKENS
from ref.gemma4.kv_cache import init_cache
from ref.gemma4.multimodal import GEMMA4_MEDIA, prompt_inputs, soft_rows
from ref.gemma4.params import TEXT
from ref.gemma4.prompts import GEMMA4_TOKENS, prompt_tokens
from ref.gemma4.schedule import chunk_arrays, chunk_bounds, image_runs, prompt_lengths
from ref.gemma4.step import apply_step, check_step_values, step
from ref.gemma4.text_config import TextConfig
from ref.gemma4.tower import VisionTower, checkpoint_loader


def attention_for(mode, *, prefill, batch, queries, ctx_len):
    """The attention function of one phase: `reference`, or `blocked` in a QEfficient mode.

    mode: None (dense), any name `ref.blocking.resolve` takes (in a prefill phase `q`, `kv`,
    `qkv`, `online` are the prefill modes; the row's defaults, clipped to the phase), or a
    `ref.blocking.BlockingConfig` (its own options); batch, queries, ctx_len: the phase's B, S
    and shortest key axis.
    """
    if isinstance(mode, BlockingConfig):
        return partial(blocked, config=mode)
    try:
        config = for_phase(mode, prefill=prefill, batch=batch, queries=queries, kv_len=ctx_len)
    except ValueError as e:
        phase = "prefill" if prefill else "decode"
        raise ValueError(f"{phase}_blocking={mode!r}: {e}") from e
    return reference if config is None else partial(blocked, config=config)


@partial(jax.jit, static_argnames=("config", "attention", "last_only", "mesh", "moe"))
def sharded_step(params, lm_head, cache, *inputs, config, attention, last_only, mesh, moe=None):
    """`apply_step` (same arguments) with the cache it returns kept in `ref.sharding`'s layout
    on `mesh`: left to itself, XLA splits a replicated cache's head_dim instead (measured on a
    full layer with one KV head), and the next step would compile for that layout."""
    out = apply_step(
        params, lm_head, cache, *inputs, config=config, attention=attention, last_only=last_only,
        moe=moe,
    )  # fmt: skip
    return dict(out, cache=sharding.constrain(out["cache"], mesh))


class Gemma4:
    """Gemma 4 (vision tower + text decoder) with its parameters; generation (greedy or sampled)
    that stops a row at its first stop id.

    text_config: TextConfig; text_params: the checkpoint's `model.language_model` tree;
    lm_head: [V, D] or None (tied to the token embedding); vision: an object with
    `embed(patches, grids)` → list of [h·w/k², text_hidden] (a `ref.gemma4.VisionTower`);
    audio: an object with `encode_waveforms(waveforms, embed=True, name=…)` → ([Σ n_i,
    text_hidden], per-clip counts n_i) (a `ref.gemma4.audio_tower.AudioTower`);
    mesh: None (one device) or a `jax.sharding.Mesh` the parameters and the KV cache are split
    over by `ref.sharding.RULES` (leaves are read block by block: see `sharding.put`), with
    any axis names; an explicit-axis mesh (`jax.make_mesh`'s default) is used with Auto axes
    (`sharding.auto_axes`); stop: the stop ids (`ref.gemma4.decoding.stop_ids`), pad: the
    id a finished row is padded with; suppress: the ids generation never chooses
    (`ref.gemma4.decoding.Suppress`).
    """

    media = GEMMA4_MEDIA  # how its processor reads pixels and samples

    def __init__(
        self,
        text_config,
        text_params,
        lm_head=None,
        vision=None,
        dtype=jnp.float32,
        tokens=GEMMA4_TOKENS,
        mesh=None,
        stop=(),
        pad=0,
        audio=None,
        suppress=None,
    ):
        self.config = text_config
        self.stop, self.pad = tuple(stop), int(pad)
        self.suppress = suppress or decoding.Suppress()
        self.tokens = tokens
        self.dtype = jnp.dtype(dtype)
        self.mesh = mesh = sharding.auto_axes(mesh)
        self.params = sharding.put(text_params, self.dtype, mesh, TEXT)
        self.lm_head = (
            None if lm_head is None else sharding.put(lm_head, dtype, mesh, "lm_head.weight")
        )
        self.vision = vision
        self.audio = audio
        self.step_fn = None

    def with_step(self, step_fn, vision=None):
        """This model with each text step run by `step_fn(params, lm_head, cache, ids,
        positions, vision_embeds, image_idx, *, config, attention)` → the step's dict (as
        `ref.gemma4.step.apply_step` with last_only), e.g. a model of a device's numerics, and
        its vision tower replaced by `vision` when given (anything with `embed(patches,
        grids)`, what `generate` calls; `generate_from` also reads its `config`'s patch and
        pooling sizes). Parameters are shared, not copied; this model is unchanged."""
        other = copy.copy(self)
        other.step_fn = step_fn
        other.vision = self.vision if vision is None else vision
        return other

    @classmethod
    def from_params(cls, hf_config, params, dtype=jnp.float32, mesh=None, generation_config=None):
        """From an HF config dict and a checkpoint tree (`model.language_model.…`, optional
        `lm_head.weight`, `model.vision_tower`/`model.embed_vision` for images, and
        `model.audio_tower`/`model.embed_audio` where the config has an `audio_config`); mesh: see
        the class; generation_config: the checkpoint's generation_config.json as a dict (its
        stop, pad and suppressed ids; None: config.json's stop and pad ids)."""
        if hf_config.get("model_type") == "gemma4_unified":
            raise ValueError(
                "model_type='gemma4_unified': load it with unified_model.Gemma4Unified"
            )
        model = params.get("model", {})
        text = model.get("language_model", model)
        if "embed_tokens" not in text or "layers" not in text:
            raise ValueError(
                f"parameter tree with keys model.{sorted(model)[:6]} holds no Gemma 4 text "
                "decoder: expected model.language_model.{embed_tokens,layers,…}"
            )
        vision = None
        if "vision_tower" in model and "embed_vision" in model:
            vision = VisionTower.from_params(hf_config, params, dtype, mesh)
        audio = None
        if hf_config.get("audio_config") is not None:
            audio = AudioTower.from_params(hf_config, params, dtype, mesh)
        lm_head = params.get("lm_head", {}).get("weight")
        config = TextConfig.from_hf(hf_config)
        stop, pad, suppress = decoding.generation_ids(generation_config, hf_config)
        tokens = prompt_tokens(hf_config)
        return cls(config, text, lm_head, vision, dtype, tokens, mesh, stop, pad, audio, suppress)

    @classmethod
    def from_pretrained(cls, model_dir, dtype=jnp.float32, mesh=None, generation_config=None):
        """From an HF model folder, read by the checkpoint loader the `weights` package installs;
        with a mesh, each device reads only its blocks from the files' byte ranges;
        generation_config: see `from_params` (`weights.generation_config(model_dir)` reads the
        folder's)."""
        hf_config, params = checkpoint_loader()(model_dir, lazy=mesh is not None)
        return cls.from_params(hf_config, params, dtype, mesh, generation_config)

    def generate(self, input_ids, patches=None, grids=None, *, audios=(), **options):
        """Generation → [B, N] int token ids, N ≤ max_new_tokens (see `generate_embedded`).

        input_ids: [B, L], each image already a run of image tokens and each audio clip a run
        of audio tokens; patches/grids: the images in order of appearance, row by row, as
        `VisionTower.embed` takes them; audios: the clips in order of appearance, row by row,
        each [n] float samples at 16 kHz, 1 ≤ n ≤ 480,000; options: those of
        `generate_embedded` (max_new_tokens, chunk_size, prefill_blocking, decode_blocking,
        lengths, sliding_ring, stop, pad, sampling, moe_prefill, moe_decode).
        """
        images = []
        if grids:
            if self.vision is None:
                raise ValueError("images given but the model has no vision tower")
            images = self.vision.embed(patches, grids)
        return self.generate_embedded(input_ids, images, audio=self._embed_audio(audios),
                                      **options)  # fmt: skip

    def _embed_audio(self, audios):
        """Each clip's soft tokens after embed_audio: list of [n_i, text_hidden]."""
        if not len(audios):
            return []
        if self.audio is None:
            raise ValueError(f"{len(audios)} audio clips given but the model has no audio tower")
        embeds, counts = self.audio.encode_waveforms(audios, embed=True, name="audios")
        cu = np.cumsum([0, *counts])
        return [embeds[a:b] for a, b in zip(cu[:-1], cu[1:], strict=True)]

    def generate_from(
        self,
        prompt,
        images=(),
        *,
        videos=(),
        audios=(),
        max_soft_tokens=280,
        video_soft_tokens=VIDEO_SOFT_TOKENS,
        num_frames=VIDEO_FRAMES,
        tokenize=None,
        **options,
    ):
        """Generation for one prompt with images and videos as pixels and audio as samples → [N]
        int ids, N ≤ max_new_tokens (the last a stop id when N < max_new_tokens).

        prompt: text with one `self.tokens.image_token` per image, one `video_token` per video
        and one `audio_token` per audio clip, in any order (tokenize(str) → ids needed; the text
        is expanded first, then tokenized, as Gemma4Processor does), or token ids with one
        image/video/audio token id per item; images:
        [H, W, 3|4] or [H, W] uint8, resized into `max_soft_tokens` each as Gemma 4's image
        processor does; videos: [T, H, W, 3] uint8 frames or (frames, fps) pairs, `num_frames`
        kept of each, resized into `video_soft_tokens` as its video processor does (see
        `ref.gemma4.multimodal.prompt_inputs`); audios: [n] float samples at 16 kHz each, 1 ≤ n
        ≤ 480,000 (30 s), expanded to their soft-token counts; options: those of
        `generate_embedded`.
        """
        if (len(images) or len(videos)) and self.vision is None:
            raise ValueError("images or videos given but the model has no vision tower")
        if len(audios) and self.audio is None:
            raise ValueError(f"{len(audios)} audio clips given but the model has no audio tower")
        ids, patches, grids, audios = prompt_inputs(
            prompt,
            images,
            videos,
            audios,
            **self.media_sizes(),
            media=self.media,
            tokens=self.tokens,
            tokenize=tokenize,
            max_soft_tokens=max_soft_tokens,
            video_soft_tokens=video_soft_tokens,
            num_frames=num_frames,
        )
        return self.generate(ids[None], patches, grids, audios=audios, **options)[0]

    def media_sizes(self):
        """The patch and pooling sizes its processor cuts images into (its tower's; 1 without)."""
        c = getattr(self.vision, "config", None)
        return {k: getattr(c, k, 1) for k in ("patch_size", "pooling_kernel_size")}

    def generate_embedded(
        self,
        input_ids,
        images,
        *,
        audio=(),
        max_new_tokens,
        chunk_size=None,
        prefill_blocking=None,
        decode_blocking=None,
        lengths=None,
        sliding_ring=False,
        stop=None,
        pad=None,
        sampling=None,
        moe_prefill=None,
        moe_decode=None,
        assistant=None,
        num_speculative_tokens=None,
        rounds=None,
    ):
        """Generation from images already embedded → [B, N] int ids: each row ends at its
        first stop id (kept) and is padded after it with `pad`; N is max_new_tokens, or fewer
        when every row has stopped (transformers' `generate`).

        images: list of [n_i, text_hidden] soft tokens of each image run (an image or a video
        frame), in order of appearance, row by row; audio: the same of each audio run (a clip;
        clips of no soft tokens are skipped: they have no run);
        max_new_tokens: tokens to generate per row; chunk_size: None prefills each prompt in
        one step, else at most chunk_size tokens per step (image runs are never split, see
        `chunk_bounds`); prefill_blocking, decode_blocking: None (dense), a mode name or a
        `ref.blocking.BlockingConfig` (see `attention_for`); lengths: [B] prompt lengths of
        right-padded rows (default: all L); sliding_ring: keep sliding layers' keys in a ring
        of sliding_window slots (see `ref.gemma4.kv_cache.init_cache`); stop: stop ids (None:
        the model's, () never stops); pad: the pad id (None: the model's); sampling: None
        (greedy) or a `ref.gemma4.decoding.Sampling` (row r's n-th token drawn with (seed, r, n));
        moe_prefill, moe_decode: how each phase runs the experts (`ref.moe_modes`: None, dense,
        gather, nsp:num_nsp=N,packed_chunk=C; nsp's counts must divide E and B × chunk length);
        assistant: None, or an MTP drafter (`ref.gemma4.assistant.AssistantModel`): greedy
        speculative decoding (`ref.gemma4.speculative`), the same tokens in fewer target
        steps, num_speculative_tokens drafts a round (None: the assistant's
        generation_config, else `assistant.DEFAULT_DRAFTS`), each round's drafts proposed
        and accepted appended to `rounds` (a list) when given.
        """
        ids = np.asarray(input_ids)
        if ids.ndim != 2 or ids.shape[1] == 0:
            raise ValueError(f"input_ids {ids.shape}: expected [batch, prompt_len > 0]")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens!r}: expected an int >= 1")
        if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
            raise ValueError(f"chunk_size={chunk_size!r}: expected None or an int >= 1")
        b, width = ids.shape
        lengths = prompt_lengths(lengths, b, width)
        validate.token_ids(
            "input_ids", ids, self.config.vocab_size, valid=np.arange(width) < lengths[:, None]
        )
        rows = [ids[i, : lengths[i]] for i in range(b)]
        runs = [image_runs(r, *self.config.vision_token_ids) for r in rows]
        c = self.config
        audio_ids = () if c.audio_token_id is None else (c.audio_token_id,)
        vision_embeds = soft_rows(rows, images, audio, hidden=c.hidden_size,
                                  vision_ids=c.vision_token_ids, audio_ids=audio_ids)  # fmt: skip
        if vision_embeds is not None:
            vision_embeds = jnp.asarray(vision_embeds, self.dtype)
        drafts = speculative.drafts_for(assistant, num_speculative_tokens, sampling, self)
        ctx_len = int(lengths.max()) + max_new_tokens + drafts
        schedule = [chunk_bounds(len(r), ru, chunk_size) for r, ru in zip(rows, runs, strict=True)]
        seq = max(e - s for bounds in schedule for s, e in bounds)
        # block counts must fit the shortest key axis any layer attends over
        ring = min(self.config.sliding_window, ctx_len) if sliding_ring else ctx_len
        prefill = attention_for(
            prefill_blocking, prefill=True, batch=b, queries=seq, ctx_len=min(ctx_len, ring + seq)
        )
        decode = attention_for(
            decode_blocking, prefill=False, batch=b, queries=1, ctx_len=min(ctx_len, ring + 1)
        )
        cache = sharding.sharded(
            partial(init_cache, self.config, b, ctx_len, self.dtype, ring=sliding_ring,
                    drafts=drafts), self.mesh,
        )  # fmt: skip
        experts = self.config.num_experts
        moe = (moe_modes.for_phase(moe_prefill, "prefill", experts, b * seq),
               moe_modes.for_phase(moe_decode, "decode", experts, b))  # fmt: skip
        cache, logits, hidden = self._prefill(cache, rows, schedule, seq, vision_embeds, prefill,
                                              moe[0])  # fmt: skip
        stop, pad = self.stop if stop is None else stop, self.pad if pad is None else pad
        if assistant is not None:
            verify = attention_for(decode_blocking, prefill=False, batch=b, queries=drafts + 1,
                                   ctx_len=min(ctx_len, ring + drafts + 1))  # fmt: skip

            def run(cache, ids, positions):
                return self._run(cache, ids, positions, attention=verify, moe=moe[1],
                                 last_only=False)  # fmt: skip

            return speculative.generate(self, assistant, run, (cache, logits, hidden), lengths,
                                        max_new_tokens, drafts, stop, pad, rounds)  # fmt: skip
        stopper = decoding.Stopper(stop, pad, b)
        return self._decode(
            cache, logits, lengths, max_new_tokens, decode, stopper, sampling, moe[1]
        )

    def _run(self, cache, ids, positions, vision_embeds=None, image_idx=None, *, attention, moe,
             last_only=True):  # fmt: skip
        args = (self.params, self.lm_head, cache, jnp.asarray(ids), jnp.asarray(positions))
        args += (vision_embeds, image_idx)
        if self.step_fn is not None:
            # a step function of its own runs the experts its own way (dense when not told)
            more = {} if moe.name == "dense" else {"moe": moe}
            return self.step_fn(*args, config=self.config, attention=attention, **more)
        kw = dict(config=self.config, attention=attention, last_only=last_only, moe=moe)
        if self.mesh is None:
            return step(*args, **kw)
        check_step_values(self.config, *args[2:])
        return sharded_step(*args, **kw, mesh=self.mesh)

    def _prefill(self, cache, rows, schedule, seq, vision_embeds, attention, moe):
        """Every row's chunks, chunk k of each row in step k → (cache, [B, V] logits and [B, D]
        final-norm hidden states (None where the step gives none) of each row's last prompt
        token)."""
        b = len(rows)
        image_idx = None if vision_embeds is None else jnp.zeros((b, 1), jnp.int32)
        last, hidden = [None] * b, [None] * b
        for k in range(max(len(s) for s in schedule)):
            chunk_ids, chunk_pos = chunk_arrays(rows, schedule, k, b, seq)
            out = self._run(
                cache, chunk_ids, chunk_pos, vision_embeds, image_idx, attention=attention, moe=moe
            )
            cache, image_idx = out["cache"], out.get("image_idx")
            for i, bounds in enumerate(schedule):
                if k == len(bounds) - 1:
                    last[i] = out["logits"][i, 0]
                    hidden[i] = out["hidden"][i, 0] if "hidden" in out else None
        return cache, jnp.stack(last), None if None in hidden else jnp.stack(hidden)

    def _decode(self, cache, logits, lengths, max_new_tokens, attention, stopper, sampling, moe):
        """Tokens from the prompt's last logits, one decode step each, until max_new_tokens or
        every row has stopped → [B, N]."""
        suppress = self.suppress
        first = decoding.choose(np.asarray(logits, np.float32), sampling, 0, None, suppress)
        tokens = [stopper(first)]
        position = jnp.asarray(lengths, jnp.int32)
        for n in range(1, max_new_tokens):
            if stopper.done:
                break
            token = jnp.asarray(tokens[-1])
            out = self._run(cache, token[:, None], position[:, None], attention=attention, moe=moe)
            cache, position = out["cache"], position + 1
            logits = np.asarray(out["logits"][:, 0], np.float32)
            tokens.append(stopper(decoding.choose(logits, sampling, n, None, suppress)))
        return np.stack(tokens, axis=1)
