"""What differs between the TensorFlow, JAX and PyTorch backends, by concern;
the rest of keras-ft is backend-agnostic.

- `fit_loop`: how each backend's `fit()` loop calls `train_function`.
- `random_state`: global random generators beyond Python's and NumPy's.
- `host_memory`: views of a state in host memory, and arrays handed back.
- `device_memory`: snapshots on the accelerator and their move to the host.
- `finiteness`: whether a state holds a NaN or an infinity.
- `cross_process`: variables split across processes, and agreeing on values.

Callers import the module of the concern they need.
"""
