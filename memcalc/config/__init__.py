"""Configuration: validated model configs from flags, YAML files and Hugging Face config.json."""
