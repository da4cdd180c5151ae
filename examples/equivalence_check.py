"""Check your own Keras model's tower training against MirroredStrategy, bit for bit.

What it teaches: how to prove a hand-built data-parallel step computes what
``tf.distribute`` computes. ``towers.TowerTrainer`` with ``all_reduce="naive"``
adds the towers' gradients left to right on tower 0, the order MirroredStrategy's
``ReductionToOneDevice`` uses, so after the same batches every weight is
*bitwise* equal, provided both run inside ``towers.allreduce.as_written()``
(which
stops Grappler from reordering additions). The per-weight report gives the max
abs error and ULP distance, so a failure shows at once whether it is rounding
(a few ULPs) or a bug. Batches of 30 over 4 towers split 8/8/8/6, as
MirroredStrategy splits them; the last batch of 27 splits 7/7/7/6.

Run: python examples/equivalence_check.py [--steps 4]
"""

from __future__ import annotations

import argparse

import towers


def my_model():  # type: ignore[no-untyped-def]
    """Your model here: any built Keras model from a deterministic factory."""
    import keras

    init = keras.initializers.GlorotUniform
    inp = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(8, 3, activation="relu", kernel_initializer=init(1))(inp)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(32, activation="tanh", kernel_initializer=init(2))(h)
    out = keras.layers.Dense(10, kernel_initializer=init(3))(h)
    return keras.Model(inp, out, name="my_model")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--towers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4, help="training steps (default 4)")
    args = parser.parse_args()
    devices = towers.simulate_devices(args.towers)  # first thing: before TensorFlow starts
    import keras

    from reference import MirroredTrainer
    from towers.allreduce import as_written
    from towers.testing import assert_weights_close, weight_report
    from towers.training.data import batches, digits

    x, y, _, _ = digits()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    mine = towers.TowerTrainer(my_model, lambda: keras.optimizers.Adam(1e-2), loss,
                               devices=devices, all_reduce="naive", variables="replicated")
    ref = MirroredTrainer(my_model, lambda: keras.optimizers.Adam(1e-2), loss, devices,
                          cross_device_ops="reduction_to_one_device")
    n = 30 * args.steps - 3  # the last batch is 27
    with as_written():
        for step, (xb, yb) in enumerate(batches(x[:n], y[:n], 30, seed=0)):
            a, b = float(mine.train_step(xb, yb)), float(ref.train_step(xb, yb))
            print(f"step {step}: batch {len(xb):2d}  towers loss {a:.7f}  MirroredStrategy {b:.7f}")
    names = [w.path for w in mine.model.weights]
    for name, err, ulps in weight_report(mine.get_weights(), ref.get_weights(), names):
        print(f"  {name:<28} max abs error {err:.3g}  ({ulps} ULP)")
    assert_weights_close(mine.get_weights(), ref.get_weights(), names=names)  # atol=0: bitwise
    print("OK: every weight is bitwise equal to MirroredStrategy's")


if __name__ == "__main__":
    main()
