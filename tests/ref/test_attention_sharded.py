"""Head-parallel blocked attention sharded over a 4-device CPU mesh (shard_map over the heads;
meshes with auto and explicit axes, any names) equals the dense reference (float64, ≤ 1e-12
relative). Runs in a subprocess because the device count is fixed when jax starts."""

import textwrap

from tests.util import run_on_host_devices

SCRIPT = textwrap.dedent(
    """
    import time
    from functools import partial
    start = time.time()
    import jax
    jax.config.update("jax_enable_x64", True)
    import numpy as np
    from jax.sharding import Mesh
    from ref.attention import blocked, reference

    assert jax.device_count() == 4, jax.devices()
    # auto axes (jax.sharding.Mesh) and explicit ones (jax.make_mesh's default), any names
    meshes = [Mesh(np.array(jax.devices()), ("heads",)), jax.make_mesh((2, 2), ("data", "model")),
              jax.make_mesh((4,), ("model",))]
    rng = np.random.default_rng(0)
    cases = [
        (dict(mode="kv", num_kv_blocks=2, headpar_split=0, skip_kv=True), 8, 4, True),
        (dict(mode="hqkv", head_block_size=1, num_q_blocks=2, num_kv_blocks=2), 8, 4, True),
        (dict(mode="prefill_online", prefill_block_chunks=2, num_kv_blocks=2), 4, 4, False),
    ]
    for (opts, h, hkv, vision), mesh in zip(cases, meshes):
        b, s, t, d = 2, 6, 13, 8
        q = rng.normal(size=(b, h, s, d)) * 0.5
        k, v = rng.normal(size=(2, b, hkv, t, d))
        q_pos = np.array([[4, 5, 6, 7, 8, -1], [0, 1, 2, 3, 4, 5]])
        kv_pos = np.array([list(range(9)) + [-1] * 4, list(range(6)) + [-1] * 7])
        runs = np.array([-1, 0, 0, -1, -1, 1, 1, 1, -1, -1, -1, -1, -1])
        grp = {}
        if vision:
            grp = dict(q_group=np.where(q_pos >= 0, runs[q_pos], -1),
                       kv_group=np.where(kv_pos >= 0, runs[kv_pos], -1))
        want = np.asarray(reference(q, k, v, q_pos, kv_pos, sliding_window=5, **grp))
        # one jit: eager would compile each of the unrolled blocks' primitives on its own
        fn = jax.jit(partial(blocked, sliding_window=5, mesh=mesh, **opts))
        got = fn(q, k, v, q_pos, kv_pos, **grp)
        assert len(got.sharding.device_set) == 4, got.sharding
        err = np.abs(np.asarray(got) - want).max() / np.abs(want).max()
        assert err <= 1e-12, (opts, err)
        print(opts["mode"], err, time.time() - start)
    try:
        blocked(q, k[:, :3], v[:, :3], q_pos, kv_pos, mesh=mesh, mode="kv", num_kv_blocks=2)
    except ValueError as e:
        assert "evenly" in str(e) or "multiple" in str(e), e
    else:
        raise AssertionError("kv heads that do not split over the mesh were accepted")
    print("OK")
    """
)


def test_head_parallel_sharded_over_four_devices():
    print(run_on_host_devices(SCRIPT, 4))
