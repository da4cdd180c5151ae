"""Reference trainers built on ``tf.distribute``: what ``towers.TowerTrainer`` is tested against.

``MirroredTrainer`` (MirroredStrategy: replicated variables) and
``CentralStorageTrainer`` (CentralStorageStrategy: variables on a parameter device)
share ``towers.TowerTrainer``'s constructor, ``train_step``, ``get_weights`` and
``set_weights``, so a test can build both from the same arguments and compare every
weight after every step. Both run TensorFlow's own custom training loop
(``experimental_distribute_dataset`` + ``strategy.run`` + ``compute_average_loss``).

Example:
    >>> from reference import MirroredTrainer                      # doctest: +SKIP
    >>> ref = MirroredTrainer(make_model, keras.optimizers.SGD(0.1), "mse", DEVICES[:4])
    >>> ref.train_step(x, y)                                       # doctest: +SKIP
"""

from __future__ import annotations

from reference._loop import ReferenceUnavailable, per_example_loss
from reference.central_storage import CentralStorageTrainer
from reference.mirrored import MirroredTrainer

__all__ = ["CentralStorageTrainer", "MirroredTrainer", "ReferenceUnavailable", "per_example_loss"]
