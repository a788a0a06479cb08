"""The face: the ``amped`` command line (``amped compare``, ``amped doctor``, ``amped tune``)
and its pages.

Importing ``amped`` never imports this package. The modules that draw the terminal and
the compare report need the ``cli`` extra (rich, matplotlib); :class:`Task`, the
built-in task and the doctor's page (whose plot alone needs matplotlib) need only torch.
"""

from amped.cli.doctor_report import save_doctor_html

__all__ = ["save_doctor_html"]
