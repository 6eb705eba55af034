"""``python -m cpa ...`` -- same as the ``cpa`` command."""

from .cli import app

if __name__ == "__main__":
    app(prog_name="cpa")
