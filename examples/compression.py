"""Gradient compression and its effect on accuracy: bytes on the wire against test accuracy.

What it teaches: a codec trades bytes for accuracy. The same CNN is trained on the 8×8
digits over 4 simulated towers, with the same data order, once per codec, each time
through ``towers.compressed("ring", codec)``:

* ``uncompressed`` (the ``identity`` codec): the ring's own float32 sum, the baseline;
* ``fp16`` / ``bf16``: every tower sends ``g / n`` in a 16-bit float — half the bytes,
  each element rounded to 11 (fp16) or 8 (bf16) significant bits; stateless;
* ``topk(0.1)``: every tower sends only its largest 10% of entries, as (index, value)
  pairs, gathered on tower 0 (sparse pairs cannot be added along a ring);
* ``powersgd(4)``: every weight matrix ``m × c`` is sent as two rank-4 factors,
  ``(m + c)·4`` numbers instead of ``m·c`` (biases and small matrices stay exact).

The last two drop most of each gradient, and converge anyway because of **error
feedback**: what a tower does not send this step (top-k's small entries, the part of
its gradient outside PowerSGD's rank-4 subspace) is kept in the reducer's per-tower
state and added to its next gradient, so nothing is lost (up to rounding), only
delayed. That is why they may lag in the first epochs and catch up later (the
per-epoch accuracies show it); fp16/bf16 need no feedback, their error is one rounding.

The table counts gradient bytes per tower per step as the trainer recorded them
(``trainer.last_step_stats``, every ``send`` of the traced step) without the step's
bookkeeping (the loss, the averaged non-trainable state, reading the weights), and
divides the uncompressed bytes by each codec's. It then explains why tower 0 sends
more than the others (``decode="once"``) and measures what ``decode="everywhere"``
sends instead.

Run: python examples/compression.py [--epochs 10] [--quick]
"""

from __future__ import annotations

import argparse
import textwrap
import time
from typing import Any

import towers
from towers.allreduce.machinery.primitives import traffic_kind

TOWERS = 4


def gradient_bytes(transfers: Any, devices: list[str]) -> list[int]:
    """Bytes each tower sent for the gradients in one step (bookkeeping sends left out)."""
    sent = dict.fromkeys(devices, 0)
    for t in transfers:
        if traffic_kind(t.note) == "gradients":  # the step's loss, state, guard left out
            sent[t.src] = sent.get(t.src, 0) + (t.nbytes or 0)
    return [sent[d] for d in devices]


def spread(values: list[int]) -> str:
    """``1,234`` when every value is the same, else ``min–max``."""
    low, high = min(values), max(values)
    return f"{low:,}" if low == high else f"{low:,}–{high:,}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10, help="epochs per codec (default 10)")
    parser.add_argument("--quick", action="store_true",
                        help="1 epoch, uncompressed and powersgd(4) only (for the tests)")
    args = parser.parse_args()
    if args.epochs < 1:
        parser.error("--epochs must be at least 1")
    devices = towers.simulate_devices(TOWERS)  # first thing: before TensorFlow starts
    import keras
    import numpy as np
    import tensorflow as tf

    from towers.allreduce import bf16, fp16, powersgd, record, topk
    from towers.allreduce.codecs import identity
    from towers.training.data import batches, digits
    from towers.training.models import digits_cnn

    codecs = {
        "uncompressed": identity(),
        "fp16": fp16(),
        "bf16": bf16(),
        "topk(0.1)": topk(0.1),
        "powersgd(4)": powersgd(rank=4),
    }
    epochs = args.epochs
    if args.quick:
        codecs = {name: codecs[name] for name in ("uncompressed", "powersgd(4)")}
        epochs = 1

    x, y, x_test, y_test = digits()
    params = digits_cnn(seed=0).count_params()
    steps = -(-len(x) // 64)
    print(f"{TOWERS} towers, digits_cnn: {params:,} parameters = {4 * params:,} bytes of "
          "float32 gradients per tower per step")
    print(f"Adam 3e-3, batches of 64, {epochs} epoch{'s' * (epochs > 1)} of {steps} steps, "
          "the same data order for every codec\n")
    print("test accuracy (%) after each epoch")

    results: dict[str, tuple[float, list[int]]] = {}
    trainer = None
    for name, codec in codecs.items():
        start = time.perf_counter()
        trainer = towers.TowerTrainer(
            lambda: digits_cnn(seed=0),
            lambda: keras.optimizers.Adam(3e-3),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            devices=devices,
            all_reduce=towers.compressed("ring", codec),  # decode="once", the default
            variables="replicated",
        )
        curve = []
        for epoch in range(epochs):
            for xb, yb in batches(x, y, batch_size=64, seed=epoch):
                trainer.train_step(xb, yb)
            logits = trainer.model.predict(x_test, batch_size=256, verbose=0)
            curve.append(100 * float(np.mean(np.argmax(logits, axis=1) == y_test)))
        # Counted where the step was last traced (the epoch's short last batch); the
        # gradients' bytes do not depend on the batch size.
        stats = trainer.last_step_stats
        assert stats is not None
        grads = stats.gradient_bytes_per_tower
        results[name] = (curve[-1], [grads.get(d, 0) for d in devices])
        took = time.perf_counter() - start
        print(f"  {name:<13}" + " ".join(f"{a:5.1f}" for a in curve) + f"   ({took:.1f} s)")

    fed_back = " and ".join(n for n in codecs if n.startswith(("topk", "powersgd")))
    if fed_back:
        print("\n" + textwrap.fill(
            f"{fed_back} send a small part of each gradient; error feedback keeps the rest on "
            "each tower and adds it to that tower's next gradient, so it arrives late, not "
            "never: compare the curves with uncompressed.", 88))

    base = results["uncompressed"][1]
    base_others, base_total = float(np.mean(base[1:])), sum(base)
    others = f"towers 1-{TOWERS - 1}"
    print('\ngradient bytes sent per tower per step (decode="once"); '
          "ratio = uncompressed bytes / codec bytes\n")
    header = (f"{'codec':<13} {'test acc':>8}  {'tower 0':>9}  {others:>11}  "
              f"{'ratio ' + others:>16}  {'ratio all towers':>16}")
    print(header)
    print("-" * len(header))
    for name, (accuracy, sent) in results.items():
        ratio_others = base_others / float(np.mean(sent[1:]))
        ratio_all = base_total / sum(sent)
        print(f"{name:<13} {accuracy:7.1f}%  {sent[0]:>9,}  {spread(sent[1:]):>11}  "
              f"{ratio_others:15.1f}x  {ratio_all:15.1f}x")
    print(f"\n(test set: {len(y_test)} images, one image = {100 / len(y_test):.2f} points: "
          "differences of a point or less are noise)")

    # decode="everywhere": a reducer also runs on its own. Build one for the model's
    # variables and feed it one step of (zero) gradients eagerly; the bytes it sends
    # depend on the shapes only.
    assert trainer is not None
    variables = trainer.model.trainable_variables
    everywhere = {}
    for name, codec in codecs.items():
        reducer = towers.compressed("ring", codec, decode="everywhere")
        reducer.build(variables, devices)
        grads = []
        for device in devices:
            with tf.device(device):
                grads.append([tf.zeros(v.shape, v.dtype) for v in variables])
        with record() as recorder:
            reducer.reduce_gradients(grads)
        everywhere[name] = gradient_bytes(recorder.transfers, devices)

    dense, copies = 4 * params, (TOWERS - 1) * 4 * params
    note = (
        f'Why tower 0 sends more: with decode="once" (the default) only tower 0 decodes the '
        f"reduced payload into a dense float32 gradient ({dense:,} bytes) and sends it to "
        f"each of the other {TOWERS - 1} towers: {copies:,} bytes on top of its share of the "
        "wire, whatever the codec, the uncompressed one too (PowerSGD's tower 0 also sends "
        "the orthogonalized factor P, which it decodes once as well). In exchange every "
        "replica gets bitwise the same gradient whatever the kernels do, so the replicas "
        "cannot drift apart.",
        'towers.compressed("ring", codec, decode="everywhere") lets every tower decode its '
        "own copy instead: no dense copies, so tower 0 sends no more than the others. The "
        "outputs are the same (bitwise, on CPU), and so is the accuracy, but identical "
        "replicas then rest on deterministic decoding kernels. Top-k pays for it: its "
        "sparse pairs are gathered, not all-reduced, so when every tower decodes, every "
        f"tower sends its pairs to all {TOWERS - 1} others, not only to tower 0. Measured, "
        "one step:",
    )
    print("\n" + "\n\n".join(textwrap.fill(p, 88) for p in note) + "\n")
    print(f"{'codec':<13} {'tower 0':>9}  {others:>11}  {'ratio all towers':>16}")
    base_all = sum(everywhere["uncompressed"])
    for name, sent in everywhere.items():
        print(f"{name:<13} {sent[0]:>9,}  {spread(sent[1:]):>11}  {base_all / sum(sent):15.1f}x")
    print("(uncompressed with decode=\"everywhere\" is exactly all_reduce=\"ring\")")


if __name__ == "__main__":
    main()
