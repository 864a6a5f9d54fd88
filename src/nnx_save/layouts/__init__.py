"""On-disk layouts: a single file, an HF index, a directory or list, a pod directory."""
