"""Runs the train step on 1 device and on a 4-device mesh (replicated, FSDP); prints one JSON line.

Run by tests/test_train_step.py in its own process: the 4 fake CPU devices must be requested
before JAX initialises, and the rest of the suite runs on one device.
"""

import json
import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from helpers import LOSS, max_tree_diff, tiny_model, trie_samples  # noqa: E402

from orsd_jax.batch import build_batch  # noqa: E402
from orsd_jax.loss import OrsdLoss  # noqa: E402
from orsd_jax.train_step import init_train_state, make_mesh, make_train_step  # noqa: E402

STEPS, MICRO_BATCHES = 2, 2


def run(mesh, fsdp: bool, layout: str = "packed", pack: bool = False, share_prefix: bool = False):
    graphdef, params = tiny_model()
    # Clipping then SGD with momentum: the update is linear in the gradients (Adam's is close to
    # their sign, which would hide differences), and the momentum is param-shaped state to shard.
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.5, momentum=0.9))
    graphdef, state, sharding = init_train_state(nnx.merge(graphdef, params), optimizer, mesh, fsdp)
    step = make_train_step(OrsdLoss(LOSS), optimizer, graphdef, sharding)
    batch = build_batch(
        trie_samples(),  # prompts that begin alike: with share_prefix, trees of them
        seq_multiple=16,
        batch_multiple=4 * MICRO_BATCHES,
        layout=layout,
        pack=pack,
        share_prefix=share_prefix,
    )
    metrics = []
    for _ in range(STEPS):
        state, m, _ = step(state, batch, MICRO_BATCHES)
        metrics.append({k: float(v) for k, v in m.items()})
    specs = {jax.tree_util.keystr(p): str(x.sharding.spec) for p, x in jax.tree_util.tree_leaves_with_path(state)}
    return jax.tree.map(np.asarray, state.params), metrics, specs, int(state.step)


def main():
    assert jax.device_count() == 4, jax.devices()
    single, single_metrics, _, _ = run(make_mesh(1), fsdp=False)
    out = {"single_loss": [m["loss"] for m in single_metrics]}
    # The two-stream layout on 4 devices against the packed one on 1: the same step.
    cases = [
        ("replicated", False, "packed", False, False),
        ("fsdp", True, "packed", False, False),
        ("two-stream", True, "two-stream", False, False),
        ("prompt trees", True, "two-stream", True, True),  # packed rows of several samples, as trees
    ]
    for name, fsdp, layout, pack, share_prefix in cases:
        params, metrics, specs, steps = run(make_mesh(4), fsdp, layout, pack, share_prefix)
        out[name] = {
            "param_diff": max_tree_diff(params, single),
            # Relative above 1: the raw loss sums (sum/*) run to hundreds.
            "metric_diff": max(
                abs(m[k] - s[k]) / max(1.0, abs(s[k])) for m, s in zip(metrics, single_metrics) for k in s
            ),
            "specs": specs,
            "steps": steps,
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
