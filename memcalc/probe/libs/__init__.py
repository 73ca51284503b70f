"""Runners that measure other libraries' own layers (Megatron-core, torchtitan, transformers), with their CPU shims."""
