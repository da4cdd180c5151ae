"""What the step checks before it changes anything: errors, non-finite values, inputs.

    errors.py     the package's error types (``TowersError`` and its kinds)
    nonfinite.py  one flag per tower (loss, gradients, state finite?) gathered for the
                  step's single decision: apply, skip or raise
    inputs.py     the trainer's arguments and a batch, checked before anything is traced
    reduces.py    a user's all-reduce, run once on small values when the trainer is
                  built: each output must be the sum (``check_algorithm=False``: off)
    deadline.py   ``step_timeout``: a watchdog over the step's collectives, every
                  timed-out collective a ``StepTimeout``; the update waits for all of
                  the reduction (a hung step changes nothing)
    loss_scale.py a ``LossScaleOptimizer``'s dynamic scale across towers: one finite flag
                  for every replica; ``reduce_dtype`` (docs/mixed_precision.md)
    given.py      what a trainer is given: tower devices, layers it cannot run as
                  written, ``set_weights`` arrays, a ``tf.data.Dataset`` of global batches

The step (:mod:`towers.step`) and the training tools import these modules; these
modules import nothing of the step, so the dependencies point one way.
"""
