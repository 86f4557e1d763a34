"""Model outputs shaped like Hugging Face's ``ModelOutput``: a dataclass that also behaves like
an ordered dict (``out["last_hidden_state"]``, ``out.keys()``, ``out.items()``) and a tuple
(``out[0]``, ``out.to_tuple()``). Fields that are ``None`` are left out of the dict and tuple
views, as in Hugging Face."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Iterator

import torch


@dataclass
class ModelOutput:
    """Base of the zoo's output dataclasses. Subclasses declare their fields with defaults."""

    def keys(self) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name) is not None]

    def values(self) -> list[Any]:
        return [getattr(self, k) for k in self.keys()]

    def items(self) -> list[tuple[str, Any]]:
        return [(k, getattr(self, k)) for k in self.keys()]

    def to_tuple(self) -> tuple:
        return tuple(self.values())

    def __getitem__(self, key):
        if isinstance(key, str):
            if key not in self.keys():
                raise KeyError(key)
            return getattr(self, key)
        if isinstance(key, (int, slice)):
            return self.to_tuple()[key]
        raise TypeError(f"ModelOutput index must be str, int or slice, got {type(key).__name__}")

    def __contains__(self, key) -> bool:
        return key in self.keys()

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.keys())


@dataclass
class BaseModelOutputWithPooling(ModelOutput):
    last_hidden_state: torch.Tensor | None = None
    pooler_output: torch.Tensor | None = None


def _register_pytree(cls) -> None:
    """Let torch.export / torch.compile flatten the output (its non-None fields, by name)."""
    import torch.utils._pytree as pytree

    def flatten(o):
        names = o.keys()
        return [getattr(o, n) for n in names], names

    def unflatten(values, names):
        return cls(**dict(zip(names, values)))

    def flatten_with_keys(o):
        names = o.keys()
        return [(pytree.MappingKey(n), getattr(o, n)) for n in names], names

    pytree.register_pytree_node(cls, flatten, unflatten,
                                serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
                                flatten_with_keys_fn=flatten_with_keys)


_register_pytree(BaseModelOutputWithPooling)
