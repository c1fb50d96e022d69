"""Tandem's neutral base: what both services stand on (no torch), and the composition root."""

# The distribution's name on the package index (pyproject.toml's [project] name): the
# command is `tandem`, the project is installed as `pip install tandem-serving`.
DISTRIBUTION = "tandem-serving"
