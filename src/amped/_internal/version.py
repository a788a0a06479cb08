"""amped's version, in one place: ``amped.__version__`` and the reports read it here."""

__version__ = "0.1.0"
