"""What users run: the command line (cli, options), the terminal chat (chat, conversation) and the bench
(bench, report) with its prompt sets.

Dependency rule: apps may import everything (localspec.load, core, store, api); nothing imports apps.
tests/test_layout.py checks it.
"""
