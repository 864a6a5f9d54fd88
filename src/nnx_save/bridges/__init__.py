"""The front door: pytrees (save_file / load_file), NNX models (save_model / load_model), the lazy handle (safe_open), pods (save_pod) and porting rules, over the layouts."""
