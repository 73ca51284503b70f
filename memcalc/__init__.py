"""memcalc: how many bytes of activations one GPU keeps for backward, and why.

The package is light on purpose: importing it pulls in nothing heavy, so the CLI
starts fast. sympy is imported only by `memcalc.model.formula`, torch only under
`memcalc.probe`.
"""

__version__ = "0.1.0"
