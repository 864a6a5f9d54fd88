# The optional extension built from _gather.c (see there, and nnx_save/io/_mapped.py).
import numpy as np

def gather(dest: int, map: int, map_size: int, offsets: np.ndarray, length: int, /) -> bool: ...
