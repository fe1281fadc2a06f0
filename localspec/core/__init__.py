"""The core: models, the decoding loop, drafters, acceptance, sampling, grammars and streams.

Dependency rule: core imports nothing else of localspec (no store, api or apps): it knows nothing of HTTP,
$LOCALSPEC_HOME's files or the command line, opens no file and starts no process (llama.cpp reads the model
files). What it needs from them (this machine's kept costs, whether its AMX kernels crash, the exact probe's
text) is passed in. tests/test_layout.py checks it.
"""
