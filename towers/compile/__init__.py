"""How the step is compiled: the ``tf.function`` layout of a trainer's step.

    step.py      CompiledStep (the trainer's step functions), PhasedStep (the towers under
                 the caller's Grappler settings, the update as written), FORWARD_GRAPHS
    relaxed.py   RelaxedBatch: Keras's unknown batch dimension, one trace for every size

The phases themselves are :mod:`towers.step`'s; this package only says how they are traced.
``as_written()`` (Grappler's reordering passes off) and ``replica_scope`` (the op names
MirroredStrategy gives its replicas) live with the reductions they protect
(:mod:`towers.allreduce.machinery.base`).
"""
