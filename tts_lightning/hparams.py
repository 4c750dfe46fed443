"""`HParam`: a typed attribute of a LightningModule that is one entry of its ``hparams``."""

from __future__ import annotations

from typing import Any, Generic, TypeVar, overload

T = TypeVar("T")


class HParam(Generic[T]):
    """``learning_rate: HParam[float] = HParam()`` in a LightningModule that calls
    ``save_hyperparameters()``: ``self.learning_rate`` reads and writes
    ``self.hparams["learning_rate"]``. One value, two names: editing either after construction (by
    hand, or Lightning's learning-rate finder through the attribute) changes the run and what its
    checkpoints save. ``key`` names the entry when it differs from the attribute."""

    def __init__(self, key: str | None = None) -> None:
        self.key = key

    def __set_name__(self, owner: type, name: str) -> None:
        if self.key is None:
            self.key = name

    @overload
    def __get__(self, obj: None, objtype: Any = None) -> HParam[T]: ...

    @overload
    def __get__(self, obj: object, objtype: Any = None) -> T: ...

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        if obj is None:
            return self
        return obj.hparams[self.key]

    def __set__(self, obj: Any, value: T) -> None:
        obj.hparams[self.key] = value
