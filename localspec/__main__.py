"""`python -m localspec`: the `localspec` command."""
from .apps.cli import main

if __name__ == "__main__":
    main()
