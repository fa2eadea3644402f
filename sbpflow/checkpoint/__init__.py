"""Sharded checkpoints: ``format`` (names, the manifest, safetensors files), ``write`` (atomic writing),
``read`` (listing, reading any layout's slices, export and import)."""
