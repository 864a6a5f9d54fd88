"""Other formats into safetensors: ``convert`` (PyTorch pickles, TorchScript, Orbax), above the store it reads Orbax through."""
