"""Ready-made models for the main job, examples and benchmarks."""

from __future__ import annotations

import keras

__all__ = ["digits_cnn", "mlp", "mnist_cnn"]


def digits_cnn(seed: int = 0) -> keras.Model:
    """A small CNN for 8×8×1 digits: two convolutions, a pooling, two dense layers."""
    init = keras.initializers.GlorotUniform
    inp = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(16, 3, padding="same", activation="relu",
                            kernel_initializer=init(seed))(inp)
    h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Conv2D(32, 3, padding="same", activation="relu",
                            kernel_initializer=init(seed + 1))(h)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(64, activation="relu", kernel_initializer=init(seed + 2))(h)
    out = keras.layers.Dense(10, kernel_initializer=init(seed + 3))(h)
    return keras.Model(inp, out, name="digits_cnn")


def mnist_cnn(seed: int = 0) -> keras.Model:
    """The conv-MNIST benchmark model: 28×28×1, Conv2D 32×3×3, max-pool, Dense 64, Dense 10."""
    init = keras.initializers.GlorotUniform
    inp = keras.Input((28, 28, 1))
    h = keras.layers.Conv2D(32, 3, activation="relu", kernel_initializer=init(seed))(inp)
    h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(64, activation="relu", kernel_initializer=init(seed + 1))(h)
    out = keras.layers.Dense(10, kernel_initializer=init(seed + 2))(h)
    return keras.Model(inp, out, name="mnist_cnn")


def mlp(sizes: tuple[int, ...] = (784, 2048, 2048, 10), seed: int = 0) -> keras.Model:
    """A dense stack; the default 784-2048-2048-10 has 5.8 M parameters (communication-bound)."""
    init = keras.initializers.GlorotUniform
    inp = keras.Input((sizes[0],))
    h = inp
    for k, width in enumerate(sizes[1:-1]):
        h = keras.layers.Dense(width, activation="relu", kernel_initializer=init(seed + k))(h)
    out = keras.layers.Dense(sizes[-1], kernel_initializer=init(seed + 99))(h)
    return keras.Model(inp, out, name="mlp")
