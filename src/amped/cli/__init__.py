"""The ``amped`` command line (``amped compare``).

Importing ``amped`` never imports this package. The modules that draw (``progress``,
``table``, ``plots``, ``report``, ``command``) need the ``cli`` extra (rich, matplotlib);
:class:`Task` and the built-in task (:mod:`amped.cli.default_task`) need only torch.
"""

from amped.cli.task import Task

__all__ = ["Task"]
