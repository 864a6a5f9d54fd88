"""Saving: entries and atomic writes, device -> host staging, the multi-process writer, background saves."""
