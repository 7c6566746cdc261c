"""``python -m recipes.quickstart``: see :mod:`recipes.quickstart.cli`."""
from recipes.quickstart.cli import main

main()
