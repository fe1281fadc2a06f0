"""The `localspec` command's entry point before the layout (localspec.cli:main): a checkout installed then
(`pip install -e .`) and updated since keeps a console script that imports this. New installs use
localspec.apps.cli:main."""
from .apps.cli import main

__all__ = ["main"]
