"""What localspec keeps on disk: models.toml and the registry, downloads (Hub, PyPI mirror), the memory
estimate read from GGUF headers, and this machine's calibration (costs, exact mode's verdicts).

Dependency rule: store imports core and nothing above it (api, apps). tests/test_layout.py checks it.
"""
