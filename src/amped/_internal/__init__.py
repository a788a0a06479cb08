"""amped's private toolbox: the small jobs every layer needs, each written once.

Nothing here is public API; it may change in any release. It is the lowest layer and
imports torch and the standard library only:

- :mod:`.errors`: argument errors in one voice (``... Received: name=value (of type T)``);
- :mod:`.trees`: walking nested containers of tensors;
- :mod:`.stats`: medians and quartiles of measurements;
- :mod:`.files`: atomic, symlink-safe writes;
- :mod:`.jsonio`: JSON with non-finite numbers;
- :mod:`.version`: amped's version;
- :mod:`.torch_compat`: every call into a private torch API, and torch-version checks.
"""
