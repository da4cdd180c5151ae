"""How the step is compiled: ``step.py`` holds the ``tf.function`` layout of a trainer's step.

    step.py   CompiledStep (the trainer's step functions), PhasedStep (the towers under
              the caller's Grappler settings, the update as written), RelaxedBatch (Keras's
              unknown batch dimension), FORWARD_GRAPHS

The phases themselves are :mod:`towers.step`'s; this package only says how they are traced.
"""
