"""Tasks layer: what ``amped.compare``, ``amped.tune`` and ``amped doctor`` train.

One model-factory contract for all three (:mod:`amped.tasks.task`): a factory declaring
any of ``batch_size``, ``seed`` and ``device`` returns ``(model, batches, loss_fn)`` or a
:class:`Task`. :mod:`amped.tasks.factory` finds a factory from a ``module:function``
spec (the CLI's ``--model``) and calls it by the contract; :mod:`amped.tasks.tiny_gpt`
is the built-in task, a tiny character-level GPT on Python's own standard library.
"""

from amped.tasks.task import Task

__all__ = ["Task"]
