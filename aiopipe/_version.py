"""aiopipe's version (pyproject.toml's ``version``), in a module of its own: modules of the
package read it from here, since importing the package's ``__init__`` from inside the
package would close an import circle through the public API it names."""

__version__ = "0.1.0"
