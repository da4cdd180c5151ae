"""What the step checks before it changes anything: arguments, inputs, the capability table,
a user's all-reduce, non-finite values, deadlines; and the package's error types.

The step (:mod:`towers.step`) and the training tools import these modules; these
modules import nothing of the step, so the dependencies point one way.
"""
