"""What every config section shares: pydantic's strict dataclass settings and the key users write."""

from __future__ import annotations

from pydantic import ConfigDict

# validate_by_name: a field named after a Python keyword (`async_`) is `snapshot.async` in files and
# on the command line (its alias), and either spelling is accepted back (a dumped config).
STRICT = ConfigDict(extra="forbid", use_attribute_docstrings=True, coerce_numbers_to_str=True,
                    validate_by_name=True, validate_by_alias=True)


def public(name: str) -> str:
    """The key users write for a field (`async_` -> `async`)."""
    return name[:-1] if name.endswith("_") else name
