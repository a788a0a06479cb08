"""Checkpoint files: save and load with a refusal of non-finite values and of archives
that ``torch.load`` would execute or misread.

- :mod:`.save_load`: :func:`save_checkpoint`, :func:`load_checkpoint`,
  :class:`CheckpointError`;
- :mod:`.archive`: the zip archive reader that checks a file before it is loaded;
- :mod:`.finite`: where a state's first inf or NaN is.

Depends on torch and ``amped._internal`` only; the recipes and the integrations save
through it.
"""

from amped.checkpoint.save_load import CheckpointError, load_checkpoint, save_checkpoint

__all__ = ["CheckpointError", "load_checkpoint", "save_checkpoint"]
