"""Port TensorFlow's custom-loop tutorial to your own step, and test it against towers.

What it teaches: how to prove *your* data-parallel step right. The step below is the
one of TensorFlow's tutorial "Custom training with tf.distribute.Strategy", as written
there: ``strategy.run(train_step)``, each replica dividing its loss sum with
``tf.nn.compute_average_loss(per_example_loss)`` and scaling the regularization loss
with ``tf.nn.scale_regularization_loss``. ``towers.testing.as_step`` makes it a step
in one line, and ``towers.testing.compare`` trains it beside a ``towers.TowerTrainer``
on the same batches, teacher-forced (before each step yours is set to towers'
weights), reporting the first step, variable and element outside the bound and the
bound it used.

Read the tutorial's loss rule closely: without ``global_batch_size``,
``compute_average_loss`` divides each replica's sum by *its shard size × replicas*.
On an even batch that is the global batch; on the epoch's uneven last batch (10 over
4 replicas: 3+3+3+1) it is 12, 12, 12, 4, so the last example weighs 3×. towers
divides by the true batch by default (``semantics="one_device"``);
``semantics="mirrored"`` reproduces MirroredStrategy's observable step, the tutorial's
rule included, and the difference between the two is printed (``--show-global``).

``--bug`` plants a weighting bug every port of the tutorial risks: each replica takes
``tf.reduce_mean`` of its own shard (no division by the replicas), so the summed
gradient is n times too large and the uneven shard is weighted differently. The
comparison fails at step 1 and names the variable, the element and both values.

Run: python examples/custom_loop_tutorial.py [--steps 3] [--optimizer sgd|adam] [--bug]
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import towers

LR = {"sgd": 0.1, "adam": 1e-3}
def make_model() -> Any:
    """The model of both sides: a regularized 64-32-10 MLP (the L2 makes weighting visible
    to Adam too: data and regularization gradients no longer scale together)."""
    import keras

    init = keras.initializers.GlorotUniform
    inp = keras.Input((64,))
    h = keras.layers.Dense(32, activation="tanh", kernel_initializer=init(1),
                           kernel_regularizer=keras.regularizers.L2(1e-3))(inp)  # fmt: skip
    out = keras.layers.Dense(10, kernel_initializer=init(2))(h)
    return keras.Model(inp, out, name="tutorial_mlp")


def tutorial_step(strategy: Any, model: Any, optimizer: Any, *, bug: bool = False) -> Any:
    """The tutorial's ``distributed_train_step``, as written there (``bug``: a wrong divisor)."""
    import keras
    import tensorflow as tf

    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    def compute_loss(labels: Any, predictions: Any, model_losses: Any) -> Any:
        per_example_loss = loss_object(labels, predictions)
        if bug:  # the planted bug: each replica's own mean, not its share of the global one
            loss = tf.reduce_mean(per_example_loss)
        else:
            loss = tf.nn.compute_average_loss(per_example_loss)
        if model_losses:
            loss += tf.nn.scale_regularization_loss(tf.add_n(model_losses))
        return loss

    def train_step(inputs: Any) -> Any:
        images, labels = inputs
        with tf.GradientTape() as tape:
            predictions = model(images, training=True)
            loss = compute_loss(labels, predictions, model.losses)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    @tf.function
    def distributed_train_step(dataset_inputs: Any) -> Any:
        per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)

    return distributed_train_step


def optimizer_fn(name: str) -> Any:
    """A zero-argument factory of the named optimizer."""
    import keras

    return lambda: (keras.optimizers.SGD(LR[name]) if name == "sgd"
                    else keras.optimizers.Adam(LR[name]))  # fmt: skip


def your_step(devices: list[str], optimizer: str, bug: bool = False) -> Any:
    """The tutorial's set-up: strategy, model and optimizer in its scope; then ``as_step``."""
    import tensorflow as tf

    from reference.mirrored import collective_all_reduce
    from towers.testing import as_step

    # MirroredStrategy's own CollectiveAllReduce, with process-unique collective keys so that
    # several strategies can live in one process (a test builds more than one)
    strategy = tf.distribute.MirroredStrategy(devices,
                                              cross_device_ops=collective_all_reduce(devices))
    with strategy.scope():
        model = make_model()
        opt = optimizer_fn(optimizer)()
        opt.build(model.trainable_variables)  # Keras 3 slots under a strategy: keras#19246
    step = tutorial_step(strategy, model, opt, bug=bug)
    loss = "sparse_categorical_crossentropy"
    return as_step(step, model, strategy=strategy, optimizer=opt, loss=loss)  # the one line


def towers_step(devices: list[str], optimizer: str, semantics: str = "mirrored") -> Any:
    """towers' trainer; ``"mirrored"`` divides the loss as the tutorial does."""
    import keras

    return towers.TowerTrainer(
        make_model, optimizer_fn(optimizer)(),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        devices=devices, all_reduce="ring", variables="replicated",
        semantics=semantics,
    )  # fmt: skip


def tutorial_batches(steps: int) -> list[tuple[Any, Any]]:
    """``steps − 1`` batches of 64 digits, then the epoch's uneven last batch of 10."""
    from towers.training.data import digits

    x, y, _, _ = digits()
    x = x.reshape(len(x), -1)
    out = [(x[64 * k: 64 * (k + 1)], y[64 * k: 64 * (k + 1)]) for k in range(steps - 1)]
    return [*out, (x[-10:], y[-10:])]


def global_difference(devices: list[str], data: list[Any]) -> float:
    """How far towers' default (true global mean) moves the weights from the tutorial's rule
    on the uneven last batch, relative to the update: max |Δw_global − Δw_tutorial| / max |Δw|."""
    import numpy as np

    ours, theirs = towers_step(devices, "sgd", "one_device"), your_step(devices, "sgd")
    theirs.set_weights(ours.get_weights())
    start = ours.get_weights()
    ours.train_step(*data[-1]), theirs.train_step(*data[-1])
    moved = [np.abs(b - s).max() for b, s in zip(theirs.get_weights(), start, strict=True)]
    apart = [np.abs(a - b).max() for a, b in zip(ours.get_weights(), theirs.get_weights(),
                                                  strict=True)]  # fmt: skip
    return float(max(apart) / max(moved))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--towers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="steps, the last uneven (default 3)")
    parser.add_argument("--optimizer", choices=sorted(LR), default="sgd")
    parser.add_argument("--bug", action="store_true", help="plant the weighting bug")
    parser.add_argument("--show-global", action="store_true",
                        help="also print how far towers' default denominator is from the rule")
    args = parser.parse_args()
    devices = towers.simulate_devices(args.towers)  # first thing: before TensorFlow starts
    data = tutorial_batches(args.steps)
    ours, theirs = towers_step(devices, args.optimizer), your_step(devices, args.optimizer,
                                                                   args.bug)  # fmt: skip
    from towers.testing import compare

    report = compare(ours, theirs, data)  # SGD and Adam: a derived bound, named in the report
    print(report)
    if args.show_global:
        share = global_difference(devices, data)
        print(f"towers' default (semantics='one_device') vs the tutorial's rule on the "
              f"uneven last batch: {share:.1%} of the update")  # fmt: skip
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
