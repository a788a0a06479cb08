"""Adapters that let training frameworks run amped's recipes.

Each adapter is a module of its own, imported only when used, behind an optional
extra: :mod:`amped.integrations.lightning` (``amped[lightning]``: Lightning's
``Trainer`` and Fabric), :mod:`amped.integrations.accelerate` (``amped[accelerate]``:
Accelerate, and the transformers ``Trainer`` through it, ``amped[transformers]``).
Importing ``amped`` or this package imports none of those frameworks.

Every adapter drives the same object, the :class:`~amped.recipes.TrainSetup` that
:func:`amped.prepare` builds: its forward context, backward, unscale, step, the
parameters clipping must see, its state and its teardown.
"""

__all__: list[str] = []
