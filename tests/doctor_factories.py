"""``--model`` factories for ``amped doctor`` tests: the doctor's overflow models as tasks."""

from __future__ import annotations

import itertools

import doctor_models


def exp_overflow():
    model, x, _, _ = doctor_models.exp_overflow()
    return model, itertools.repeat((x, None)), lambda out, _: out.float().mean()
