"""Gemma 4 sharded over 8 CPU devices, loaded block by block from a checkpoint transformers
wrote, for a tiny dense model (k_eq_v, PLE) and a tiny MoE model, each with a vision tower: the
dense model on a 1-d mesh (8,) and a 2-d one (2, 4) with auto axes (`jax.sharding.Mesh`), the
MoE model on a 2-d (4, 2) made by `jax.make_mesh`, whose axes are explicit:

- greedy tokens equal transformers' and one device's;
- the prefill logits, the soft tokens (encode and embed) and the KV cache equal one device's
  to 1e-5 relative, and the cache comes back split as the table says;
- every device holds exactly 1/8 of each split weight: all ≥ 2-d weights except a short list
  written here (not read from `ref.sharding.RULES`), and the KV caches whose heads divide by 8.

Runs in one subprocess because the device count is fixed when jax starts."""

import textwrap

from tests.util import run_on_host_devices

SCRIPT = textwrap.dedent(
    """
    import re, tempfile, time
    from functools import partial
    start = time.time()
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh
    from ref import sharding
    from ref.attention import reference
    from ref.gemma4.kv_cache import init_cache
    from ref.gemma4.model import Gemma4, sharded_step
    from ref.gemma4.params import dotted
    from ref.gemma4.step import step
    from tests.hf_vision import patches_for
    from tests.text_oracle import hf_generate, hf_model, prompt, text_config
    from tests.util import rel_err

    N, NEW, MARGIN = 8, 6, 1e-4
    assert jax.device_count() == N, jax.devices()
    # weights that stay whole on every device: small projections with no head, hidden or vocab
    # axis worth splitting (written independently of the table under test)
    WHOLE = re.compile(
        r"(router\\.proj|patch_embedder\\.|embed_vision\\.|per_layer_input_gate|"
        r"per_layer_projection|per_layer_model_projection)"
    )
    LAYERS = ["sliding_attention", "full_attention"]
    GRIDS = [(6, 3)]

    def tiny(moe):
        text = text_config(moe=moe, layer_types=LAYERS, k_eq_v=not moe, ple=0 if moe else 8)
        text.update(num_attention_heads=16, num_key_value_heads=8, intermediate_size=40)
        if moe:
            text.update(moe_intermediate_size=16)
        return hf_model(text, seed=12 if moe else 7)

    def leaves(model):
        tree = {"model": {"language_model": model.params, "vision_tower": model.vision.params,
                          "embed_vision": model.vision.embed_params}}
        if model.lm_head is not None:
            tree["lm_head"] = {"weight": model.lm_head}
        return dotted(tree)

    def check_bytes(named, must_split):
        split = whole = 0
        for name, a in named.items():
            held = {s.device: s.data.nbytes for s in a.addressable_shards}
            assert len(held) == N, (name, held)
            want = a.nbytes // N if must_split(name, a) else a.nbytes
            assert set(held.values()) == {want}, (name, a.shape, a.sharding.spec, held, want)
            split, whole = split + (a.nbytes if want < a.nbytes else 0), whole + a.nbytes
        return split / whole

    def prefill(model, ids, patches, ctx_len):
        # the same jitted step (shapes, statics, shardings) as generate's prefill
        packing, tower = model.vision.run(patches, GRIDS, embed=True)
        vision = jnp.asarray(np.asarray(tower["embeds"])[None], model.dtype)
        cache = sharding.sharded(
            partial(init_cache, model.config, 1, ctx_len, model.dtype, ring=False), model.mesh
        )
        pos = np.arange(ids.shape[1], dtype=np.int32)[None]
        run = step if model.mesh is None else partial(sharded_step, mesh=model.mesh)
        out = run(model.params, model.lm_head, cache, jnp.asarray(ids), jnp.asarray(pos),
                  vision, jnp.zeros((1, 1), jnp.int32), config=model.config,
                  attention=reference, last_only=True)
        return tower, out

    for moe, meshes in ((False, [(8,), (2, 4)]), (True, [(4, 2)])):
        hf = tiny(moe)
        folder = tempfile.mkdtemp()
        hf.save_pretrained(folder)
        rng = np.random.default_rng(3)
        patches = patches_for(GRIDS, rng, 12)
        row = prompt(rng, 9, [2], 96)
        ids = row[None].astype(np.int32)
        want, hf_logits = hf_generate(hf, row, patches, GRIDS, NEW)
        top2 = np.sort(hf_logits, axis=-1)[:, -2:]
        assert (top2[:, 1] - top2[:, 0]).min() > MARGIN, "pick another seed: near-tie"
        one = Gemma4.from_pretrained(folder)
        tokens = one.generate(ids, patches, GRIDS, max_new_tokens=NEW)[0]
        np.testing.assert_array_equal(tokens, want)
        ctx_len = ids.shape[1] + NEW
        tower1, out1 = prefill(one, ids, patches, ctx_len)
        # auto axes (jax.sharding.Mesh) and explicit ones (jax.make_mesh's default), any names
        for shape in meshes:
            if shape == (4, 2):
                mesh = jax.make_mesh(shape, ("data", "model"))
                assert set(mesh.axis_types) == {jax.sharding.AxisType.Explicit}, mesh
            else:
                mesh = Mesh(np.array(jax.devices()).reshape(shape), ("x", "y")[: len(shape)])
            model = Gemma4.from_pretrained(folder, mesh=mesh)
            got = model.generate(ids, patches, GRIDS, max_new_tokens=NEW)
            np.testing.assert_array_equal(got[0], want, err_msg=f"moe={moe} mesh={shape}")
            tower, out = prefill(model, ids, patches, ctx_len)
            errs = [rel_err(out["logits"], out1["logits"])]
            errs += [rel_err(tower[k], tower1[k]) for k in ("pooled", "embeds")]
            for kv in ("k", "v"):
                errs += [rel_err(out["cache"][kv][i], a) for i, a in out1["cache"][kv].items()]
            assert max(errs) <= 1e-5, (moe, shape, errs)
            ratio = check_bytes(
                leaves(model), lambda n, a: a.ndim >= 2 and not WHOLE.search(n)
            )
            cache = dotted(out["cache"])
            check_bytes(cache, lambda n, a: n[0] in "kv" and a.shape[1] % N == 0)
            print(f"moe={moe} mesh={shape}: tokens {got[0].tolist()}, max rel err "
                  f"{max(errs):.1e}, {ratio:.0%} of weight bytes split, "
                  f"{time.time() - start:.0f} s")
    print("OK")
    """
)


def test_mesh_equals_one_device_and_transformers():
    print(run_on_host_devices(SCRIPT, 8))
