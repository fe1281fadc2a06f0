"""What localspec keeps on disk: models.toml and the registry, downloads (Hub, PyPI mirror), the memory
estimate read from GGUF headers, and what is found out about this machine (store.machine: its CPU, whether
llama.cpp's AMX kernels crash) and measured on it (store.calibration: costs, exact mode's verdicts).

Dependency rule: store imports core and nothing above it (api, apps). tests/test_layout.py checks it.
"""
