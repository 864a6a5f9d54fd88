"""Pure, no I/O: the header, the dtype table, tree keys <-> names, checksums, sniffing other formats."""
