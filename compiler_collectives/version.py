"""The package's version, in a module of its own so that anything can import it without a cycle.

``pyproject.toml`` declares the same string (a fast test checks they agree).
The wire formats and the setup agreement carry it, so ranks running different
installs of compiler_collectives are told so by name.
"""

__version__ = "0.1.0"
