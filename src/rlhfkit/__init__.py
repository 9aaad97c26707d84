"""rlhfkit: reinforcement learning from human feedback for language models.

Import what you need from the submodules (``rlhfkit.core`` is pure torch and stays
light; trainers live in ``rlhfkit.trainers``)."""

__version__ = "0.2.0"
