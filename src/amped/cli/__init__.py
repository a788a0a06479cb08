"""The face: the ``amped`` command line (``amped compare``, ``amped doctor``, ``amped tune``)
and its pages, one subpackage per command (:mod:`amped.cli.compare`,
:mod:`amped.cli.tune`, :mod:`amped.cli.doctor`), the helpers they share beside them.

It parses arguments, renders (tables, plots, HTML) and handles signals and exit codes;
the work is the library's (``amped.compare``, ``amped.tune``, ``amped.doctor``).
Importing ``amped`` never imports this package. Its modules that draw the terminal and
the plots need the ``cli`` extra (rich, matplotlib).
"""

__all__: list[str] = []
