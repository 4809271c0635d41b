"""The imp-mem exception hierarchy.

Every error imp-mem raises is an :class:`ImpMemError`. The Rust core maps each
of its error values to one of these classes, in one place
(``crates/imp-mem-py/src/errors.rs``). Where a standard exception fits too, the
class also derives from it, so ``except MemoryError`` and ``except ValueError``
keep working for code that does not know imp-mem.
"""

from __future__ import annotations


class _Facts(dict):
    """The attributes the core attaches to an exception it raises."""


class ImpMemError(Exception):
    """Base class of every imp-mem error."""

    def __init__(self, *args: object) -> None:
        # The core raises ``Class(message, _Facts(...))`` and the attributes
        # are set here, when Python builds the exception: the Rust side then
        # never builds a Python object while it may hold a lock.
        if len(args) == 2 and type(args[1]) is _Facts:
            for name, value in args[1].items():
                setattr(self, name, value)
            args = args[:1]
        super().__init__(*args)


class OutOfMemory(ImpMemError, MemoryError):
    """The budget or the device refused an acquisition.

    Attributes ``asked``, ``live``, ``budget`` and ``capacity`` (bytes) and
    ``tag`` carry the arithmetic; ``device_refused`` is True when the device
    itself, not the budget, said no. Raised by ``MemorySystem.wake`` it also
    carries ``needed`` (bytes the tiers not woken need), ``device_free``
    (``None`` where the backend cannot read its device), ``budget_free``,
    ``woken`` and ``still_asleep`` (those tiers still sleep; wake again).
    Refused by a device ledger (a backend with ``attach_ledger``), it carries
    ``ledger_headroom``: the bytes the ledger could grant then.
    """

    asked: int
    live: int
    budget: int
    capacity: int
    tag: str
    device_refused: bool


class CapacityError(ImpMemError):
    """A pool cannot admit what was asked; nothing was changed.

    Raised by ``KVCacheManager`` admission, append and load with the block
    arithmetic as attributes: ``needed``, ``free``, ``growable`` (blocks a
    growable pool can still commit), ``evictable``, ``pinned`` and ``pool``
    (``"kv"`` or ``"swa"``).
    """


class PhaseViolation(ImpMemError):
    """An acquisition while serving (strict mode) or a refused phase transition."""


class Asleep(PhaseViolation):
    """A tier put to sleep (``MemorySystem.sleep``) was used before ``wake()``."""


class StaleSpan(ImpMemError):
    """A span or handle used after the memory behind it was reset or released."""


class PlanFailure(ImpMemError):
    """The configuration does not fit its budget; the message is the itemised report.

    Attributes: ``charges`` (list of ``{"key", "label", "bytes"}``, the KV pool
    at its full target), ``total`` (their sum), ``budget``, ``over_by``
    (``total - budget``), ``levers`` (up to three ``{"setting", "from", "to",
    "frees", "sufficient"}``, largest first), ``kind`` (``"over_budget"`` or
    ``"below_admission_floor"``, or ``"ledger_full"`` when a device ledger
    refuses a tenant whose floor does not fit beside the others': then the
    charges are the tenants' floors), ``report`` (the message) and
    ``max_batch_fits`` (the largest ``max_batch`` whose plan fits, every
    other setting as asked, or ``None``: the ``max_batch`` lever's figure,
    given even when the three largest levers leave it out).
    """

    charges: list[dict]
    total: int
    budget: int
    over_by: int
    levers: list[dict]
    kind: str
    report: str
    max_batch_fits: int | None


class WeightsOverflow(ImpMemError):
    """A checkpoint holds more than the plan gave its weights (T1's weights
    line); nothing was loaded.

    Attributes: ``tensor`` (the first tensor that does not fit), ``end`` (the
    bytes the load would reach with it, alignment included) and ``limit``
    (the plan's weight bytes).
    """

    tensor: str
    end: int
    limit: int


class BackendUnavailable(ImpMemError):
    """The requested backend cannot run on this machine (no driver, no device)."""


class InvalidArgument(ImpMemError, ValueError):
    """An argument is unusable; the message says what to change."""


class DriverError(ImpMemError):
    """The CUDA driver reported an error."""


class ImpMemWarning(UserWarning):
    """Something an operator should fix, such as an acquisition while serving."""


__all__ = [
    "BackendUnavailable",
    "CapacityError",
    "DriverError",
    "ImpMemError",
    "ImpMemWarning",
    "InvalidArgument",
    "OutOfMemory",
    "PhaseViolation",
    "PlanFailure",
    "StaleSpan",
]
