"""Transports for reading and writing: HTTP and fsspec."""
