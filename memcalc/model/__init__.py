"""The model: the saved-tensor ledger, knobs, implementations, layouts, numbers and formulas."""
