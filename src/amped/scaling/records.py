"""A typed record of each ``update()``, fetched from the device without syncs of its own.

``update()`` stacks its numbers into one small device tensor and leaves it there. The
next ``step()`` must bring one flag to the host anyway (was there an inf or NaN?), and
brings the waiting records along in the same transfer. So with ``record_history=True``
the training loop still syncs once per step, and the history lags the device by at most
the latest update, which reading :attr:`History.records` fetches.

Example:
    >>> import torch, amped
    >>> param = torch.zeros(2, requires_grad=True)
    >>> optimizer = torch.optim.SGD([param], lr=0.1)
    >>> scaler = amped.GradScaler("cpu", record_history=True)
    >>> scaler.scale(param.sum() * float("inf")).backward()
    >>> scaler.step(optimizer)
    >>> scaler.update()
    >>> record = scaler.history[-1]
    >>> record.step_skipped, record.scale, record.new_scale
    (True, 65536.0, 32768.0)
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["History", "ScaleRecord"]

# With optimizers that never sync in step() (fused, capturable), update() fetches the
# records waiting on the device once this many wait.
FLUSH_AT = 256


@dataclasses.dataclass(frozen=True)
class ScaleRecord:
    """What one ``update()`` saw and did.

    Attributes:
        step: the update's index, from 0 (it survives ``state_dict`` round trips).
        scale: the scale this iteration's gradients were multiplied by.
        found_inf: whether any gradient of the iteration held an inf or NaN.
        step_skipped: whether any ``optimizer.step()`` of the iteration was skipped.
        new_scale: the scale after the update, used by the next iteration.
        growth_tracker: consecutive clean iterations after the update.
        overflow_streak: consecutive overflows after the update (0 without hysteresis).
    """

    step: int
    scale: float
    found_inf: bool
    step_skipped: bool
    new_scale: float
    growth_tracker: int
    overflow_streak: int


class History:
    """The records of a scaler, some of them possibly still on the device."""

    def __init__(self) -> None:
        self._records: list[ScaleRecord] = []
        self._pending: list[tuple[int, torch.Tensor]] = []

    def add(
        self, step: int, floats: list[torch.Tensor], ints: list[torch.Tensor], *, may_sync: bool
    ) -> None:
        """Queue one update's numbers: ``floats`` (float32: scale, found_inf, step_skipped,
        new_scale) and ``ints`` (int32: growth_tracker, and overflow_streak if any).

        Launches device ops only. Fetches the queue (one sync) if it has grown past
        ``FLUSH_AT`` and ``may_sync`` says the iteration has not synced yet.
        """
        # float64 holds float32 scales and int32 counters exactly; MPS has no float64.
        dtype = torch.float32 if floats[0].device.type == "mps" else torch.float64
        values = torch.cat([torch.stack(floats).to(dtype), torch.stack(ints).to(dtype)])
        self._pending.append((step, values))
        if may_sync and len(self._pending) >= FLUSH_AT:
            self.records()

    def fetch(self, numbers: torch.Tensor) -> list[float]:
        """Return ``numbers.tolist()`` (1-d), bringing the queued records in the same
        transfer (one sync)."""
        if not self._pending:
            return list(numbers.tolist())
        dtype = self._pending[0][1].dtype
        count = numbers.numel()
        flat = torch.cat([numbers.to(dtype)] + [v for _, v in self._pending]).tolist()
        self._unpack(flat[count:])
        return flat[:count]

    def records(self) -> list[ScaleRecord]:
        """All records, oldest first. Syncs once if some are still on the device."""
        if self._pending:
            self._unpack(torch.cat([v for _, v in self._pending]).tolist())
        return list(self._records)

    def _unpack(self, flat: list[float]) -> None:
        offset = 0
        for step, values in self._pending:
            # Without hysteresis there is no streak counter: it reads as 0.
            scale, found, skipped, new_scale, tracker, *streak = flat[offset : offset + len(values)]
            offset += len(values)
            self._records.append(
                ScaleRecord(
                    step=step,
                    scale=scale,
                    found_inf=found > 0,
                    step_skipped=skipped > 0,
                    new_scale=new_scale,
                    growth_tracker=int(tracker),
                    overflow_streak=int(streak[0]) if streak else 0,
                )
            )
        self._pending.clear()

    def __getstate__(self) -> dict[str, object]:
        # Device tensors do not pickle portably; fetch them first (one sync).
        return {"_records": self.records(), "_pending": []}

    def __len__(self) -> int:
        return len(self._records) + len(self._pending)
