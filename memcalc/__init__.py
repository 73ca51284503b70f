"""memcalc: how many bytes of activations one GPU keeps for backward, and why.

The package is light on purpose: importing it pulls in nothing heavy, so the CLI
starts fast. sympy is imported only by `memcalc.model.formula`, torch only under
`memcalc.probe`.

For notebooks, `memcalc.load`, `memcalc.estimate`, `memcalc.per_gpu`,
`memcalc.fit` and `memcalc.sweep` (docs/api.md) come from `memcalc.api`, which
is imported the first time one of them is asked for, not by `import memcalc`:
the CLI imports this package on every start.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_API = ("load", "estimate", "per_gpu", "fit", "sweep")
__all__ = ["__version__", *_API]


def __getattr__(name: str) -> Any:
    """The notebook API, loaded on first use (PEP 562)."""
    if name in _API:
        from memcalc import api

        return getattr(api, name)
    raise AttributeError(f"module 'memcalc' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_API})
